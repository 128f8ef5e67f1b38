"""`kvcalib tune` end to end: checks, OUT's lock, the search, the engine's word on the short list, OUT.

Why a module of its own: the search (calib/tune/search.py), the engine confirmation (confirm.py) and the
output (output.py) each depend on the search's values; only this module depends on all of them.
"""

from __future__ import annotations

from pathlib import Path

from calib.evaluation.fakequant import reference_arm
from calib.evaluation.run import load_causal_lm
from calib.model import load as model_mod
from calib.progress import SILENT, Progress
from calib.safety import outputs
from calib.tune import output
from calib.tune.choose import check_measurable
from calib.tune.confirm import confirm
from calib.tune.search import Clock, Log, TuneConfig, TuneError, check, search


def run(cfg: TuneConfig, log: Log = lambda _m: None, progress: Progress = SILENT) -> output.Outcome:
    """Run the search and write OUT (and --stats-out); checks first, nothing loaded until they pass."""
    clock = Clock(cfg.budget_minutes)
    check(cfg)
    with outputs.locked([(cfg.out, "--out"), (cfg.stats_out, "--stats-out")]):
        check(cfg)        # again under the lock: taking it may have put back an output a killed run moved aside
        source = model_mod.resolve_source(cfg.model)
        config = model_mod.preflight(source, trust_remote_code=cfg.trust_remote_code).text_config
        if cfg.skips >= config.num_hidden_layers:
            raise TuneError(f"--max-skip {cfg.skips}: the model has {config.num_hidden_layers} layers; give fewer")
        loaded = load_causal_lm(str(source), cfg.device, cfg.trust_remote_code, cfg.cpu_dtype)
        found, st, held = search(cfg, loaded, source, clock, log, progress)
        ref_name = reference_arm(loaded.dtype).name
        check_measurable(found, ref_name)     # before the engine is asked to confirm a short list drawn from them
        if cfg.engine is not None:
            confirm(cfg, found, st, source, loaded, held.samples, held.buckets, log, progress)
            check_measurable(found, ref_name)
        return output.finish(cfg, loaded, Path(source), found, st, held.info, clock.elapsed(), log)


__all__ = ["run"]
