"""The short list again in the real engine (`tune --engine vllm`): the engine's numbers decide where they exist.

Why: the emulation is only as good as its measured agreement with the engine (docs/design.md §6). The
candidates the rule would pick first (and the default scale 1.0) are exported as real checkpoints, each
exactly as the final one would be, into a temporary sibling of OUT (removed afterwards, and by the next run
into OUT after a crash), and measured by `calib/engine/`'s runner on the same token ids as the emulation —
the machinery `kvcalib eval --engine vllm` uses. An arm the engine refuses (e.g. no FP8 cache on this CPU)
keeps its emulated numbers and says why.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from calib.evaluation import verdict
from calib.evaluation.arms import Arm, reference_arm
from calib.recipe.dtypes import kv_dtype
from calib.safety import files, readers
from calib.tune import choose as choose_mod
from calib.tune.output import write_checkpoint
from calib.tune.search import BASELINE, TuneError


def shortlist(found: Any, th: verdict.Thresholds, n: int) -> list[Any]:
    """The candidates the rule would look at first: within the bar, fewest skips, broadest support, lowest KL."""
    scored = [c for c in found.candidates if found.entry(c.name) is not None]
    seen, out = set(), []

    def key(c: Any) -> tuple:
        e = found.entry(c.name)
        return (bool(verdict.failures(e, found.ref, th)), len(c.skip), -c.breadth(), c.simplicity(),
                choose_mod.kl(e))
    for c in sorted(scored, key=key):
        if found.measured_as.get(c.name) in seen and c.breadth() == 2:
            continue
        seen.add(found.measured_as.get(c.name))
        out.append(c)
        if len(out) == n:
            break
    return out


def confirm(cfg: Any, found: Any, st: Any, source: Path, loaded: Any, held: Any, log: Any, progress: Any) -> None:
    from calib.engine import driver
    from calib.engine.run import EngineRun

    with readers.raising(TuneError, driver.EngineError):
        version = driver.check(cfg.engine)
    short = shortlist(found, cfg.thresholds, cfg.confirm)
    root = Path(cfg.out).parent / f".{Path(cfg.out).name}.kvcalib-tmp-{os.getpid()}-engine"
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    files.make_dir(root)
    try:
        arms = []
        for j, c in enumerate(short):
            path = write_checkpoint(cfg, loaded, source, st, c, {}, out=root / f"candidate-{j}")
            arms.append(Arm(c.name, kv_dtype(c.dtype), kind="checkpoint", source=str(path), serve_skip=c.skip))
        base = found.entries.get(BASELINE)
        default = [Arm(BASELINE, kv_dtype("fp8_e4m3"), kind="default")] if base is not None else []
        ref_arm = reference_arm(loaded.dtype)
        engine = EngineRun(cfg.engine, version, str(source), str(loaded.dtype).removeprefix("torch."), held.samples,
                           held.buckets, (), 0, loaded.tokenizer,
                           getattr(loaded.config, "max_position_embeddings", None), progress)
        log(f"tune: confirming {len(short)} candidate(s) in {cfg.engine.name} {version}")
        res = engine.measure(ref_arm, default + arms)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if ref_arm.name in res:
        found.ref = replace(found.ref, engine=res[ref_arm.name])
    if base is not None:
        found.entries[BASELINE] = replace(base, engine=res[BASELINE])
    for c in short:
        found.engine[c.name] = res[c.name]
