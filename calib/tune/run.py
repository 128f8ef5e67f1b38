"""`kvcalib tune` end to end: checks, OUT's lock, the search, the engine's word on the short list, OUT.

Why a module of its own: the search (calib/tune/search.py), the engine confirmation (confirm.py) and the
output (output.py) each depend on the search's values; only this module depends on all of them. The budget's
end is set here, when the run begins; the search plans what fits before it (calib/tune/search.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from calib.evaluation.arms import reference_arm
from calib.evaluation.run import load_causal_lm
from calib.model import load as model_mod
from calib.progress import SILENT, Progress
from calib.safety import outputs
from calib.tune import output
from calib.tune import search as search_mod
from calib.tune.choose import check_measurable
from calib.tune.confirm import confirm
from calib.tune.search import Log, TuneConfig, TuneError, check, search


def run(cfg: TuneConfig, log: Log = lambda _m: None, progress: Progress = SILENT) -> output.Outcome:
    """Run the search and write OUT (and --stats-dir); checks first, nothing loaded until they pass."""
    start = search_mod.now()
    end = None if cfg.budget_minutes is None else start + 60 * cfg.budget_minutes
    check(cfg)
    with outputs.locked([(cfg.out, "--out"), (cfg.stats_out, "--stats-dir")]):
        check(cfg)        # again under the lock: taking it may have put back an output a killed run moved aside
        source = model_mod.resolve_source(cfg.model)
        config = model_mod.preflight(source, trust_remote_code=cfg.trust_remote_code).text_config
        if cfg.skips >= config.num_hidden_layers:
            raise TuneError(f"--max-skip {cfg.skips}: the model has {config.num_hidden_layers} layers; give fewer")
        loaded = load_causal_lm(str(source), cfg.eval_config().placement(), cfg.trust_remote_code)   # as eval places it
        found, st, held, kept = search(cfg, loaded, source, end, log, progress)
        ref_name = reference_arm(loaded.dtype).name
        check_measurable(found, ref_name)     # before the engine is asked to confirm a short list drawn from them
        if kept.plan.parts.confirm:
            confirm(replace(cfg, confirm=kept.plan.parts.confirm), found, st, source, loaded, held, log, progress)
            check_measurable(found, ref_name)
        return output.finish(cfg, loaded, Path(source), found, st, held.info, search_mod.now() - start, log)


__all__ = ["run"]
