"""`kvcalib tune` end to end: checks, OUT's lock, the search, the engine's word on the short list, OUT.

Why a module of its own: the search (calib/tune/search.py), the engine confirmation (confirm.py) and the
output (output.py) each depend on the search's values; only this module depends on all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from calib.evaluation import plan
from calib.evaluation.arms import reference_arm
from calib.evaluation.run import load_causal_lm
from calib.model import load as model_mod
from calib.progress import SILENT, Progress, duration
from calib.safety import outputs
from calib.tune import output
from calib.tune.choose import check_measurable
from calib.tune.confirm import confirm
from calib.tune.search import Clock, Log, TuneConfig, TuneError, check, search


def run(cfg: TuneConfig, log: Log = lambda _m: None, progress: Progress = SILENT) -> output.Outcome:
    """Run the search and write OUT (and --stats-dir); checks first, nothing loaded until they pass."""
    clock = Clock(cfg.budget_minutes)
    check(cfg)
    with outputs.locked([(cfg.out, "--out"), (cfg.stats_out, "--stats-dir")]):
        check(cfg)        # again under the lock: taking it may have put back an output a killed run moved aside
        source = model_mod.resolve_source(cfg.model)
        config = model_mod.preflight(source, trust_remote_code=cfg.trust_remote_code).text_config
        if cfg.skips >= config.num_hidden_layers:
            raise TuneError(f"--max-skip {cfg.skips}: the model has {config.num_hidden_layers} layers; give fewer")
        loaded = load_causal_lm(str(source), cfg.placement(), cfg.trust_remote_code)
        if cfg.engine is not None:             # the measuring passes leave the engine's starts their time
            clock.reserve((cfg.confirm + 2) * plan.engine_figures(loaded.device.type)[0])
        found, st, held = search(cfg, loaded, source, clock, log, progress)
        ref_name = reference_arm(loaded.dtype).name
        check_measurable(found, ref_name)     # before the engine is asked to confirm a short list drawn from them
        if cfg.engine is not None:
            n = confirmations(cfg, clock, held.samples, loaded.device.type, log)
            if n:
                confirm(replace(cfg, confirm=n), found, st, source, loaded, held.samples, held.buckets, log, progress)
                check_measurable(found, ref_name)
        return output.finish(cfg, loaded, Path(source), found, st, held.info, clock.elapsed(), log)


def confirmations(cfg: TuneConfig, clock: Clock, samples: Sequence[Any], device_type: str, log: Log) -> int:
    """How many candidates the engine confirms: `cfg.confirm`, fewer when --budget-minutes leaves no time for
    them all (each is an engine arm, and the reference and the default scale ride along), 0 to drop it."""
    left = clock.left()
    if left is None:
        return cfg.confirm
    start, rate = plan.engine_figures(device_type)
    per_arm = start + sum(len(x.ids) for x in samples) / rate
    n = max(0, min(cfg.confirm, int(left // per_arm) - 2))
    if n < cfg.confirm:
        what = "dropped" if n == 0 else f"{n} of {cfg.confirm} candidates"
        log(f"tune: --budget-minutes leaves {duration(max(left, 0))} for the engine ({per_arm:.0f} s per arm: "
            f"{start:.0f} s start + {rate:,.0f} tok/s, stated defaults): engine confirmation {what}")
    return n


__all__ = ["confirmations", "run"]
