"""Arms "as the engine serves them": `kvcalib eval --target ENGINE` evaluates each calibrated arm with the scales
that engine really uses, read from the support matrix (calib.recipe.support).

Why: an evaluation that measures the calibrated scales while the chosen engine ignores them (TensorRT-LLM's FP8 and
INT8 caches run at 1.0; SGLang runs per-head schemes at 1.0) reports a gain the user never gets. So, with a target,
the arm the report calls calibrated keeps its name and is measured with 1.0 where the engine ignores the scales,
with the max over heads where it folds them, with max(k, v) per layer where K and V share one scale
(TensorRT-LLM's TensorRT-engine backend), without q_scale where it reads none; an arm the engine refuses is
kept but marked not shippable. Each substituted arm says so in its notes (the report's Notes section).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from calib.errors import KvcalibError
from calib.evaluation.arms import Arm, EvalError
from calib.recipe import support

# --emulate name -> the backend of the target engine whose arithmetic it follows
_BACKEND_OF_EMULATION = {"vllm-cpu": "cpu", "vllm-fa3": "fa3"}

# targets that apply one scale per layer shared by K and V, max(k, v) (calib.scales.fold.shared_from_scales)
_SHARED_KV = {"trtllm-engine": "TensorRT-LLM engine"}


def stated(target: str | None, text: str | None) -> str | None:
    """The --target's version from `--engine-version` in the grammar every command reads (calib.export.serve:
    ENGINE=VERSION, or a bare VERSION of the one target): None when none was stated; EvalError (one line) for a
    version without a target, another engine's, one given twice or one the support matrix cannot parse."""
    from calib.export import serve

    if target is None:
        if text:
            raise EvalError("--engine-version needs --target (the engine it is a version of)")
        return None
    try:
        support.engine(target)
        return serve.parse_versions(text, [target]).get(target)
    except KvcalibError as e:
        raise EvalError(f"--target {target}: {e}") from None


def backend_for(target: str, emulation: str) -> str:
    """The target's backend the evaluation stands for: the one the emulation follows, else the engine's first."""
    backends = support.ENGINES[target].backends
    b = _BACKEND_OF_EMULATION.get(emulation)
    return b if b in backends else next(iter(backends))


def as_served(arms: Sequence[Arm], target: str | None, version: str | None, emulation: str) -> tuple[list[Arm], str | None]:
    """(`arms` with every calibrated arm replaced by what `target` serves of it, a note for the report); the arms
    unchanged and no note without a target."""
    if target is None:
        return list(arms), None
    e = support.ENGINES[target]
    v = support.version_of(target, version)
    backend = backend_for(target, emulation)
    where = f"{e.title} {v}" + (f" ({e.backends[backend]})" if len(e.backends) > 1 else "")
    out = [_served(a, target, v, backend, where) if a.kind in ("checkpoint", "stats") and a.dtype is not None
           and a.shippable else _unserved(a, target, v, (backend,), where) if a.dtype is not None else a for a in arms]
    return out, (f"calibrated arms evaluated as {where} serves them (--target {target}): with the scales it uses, "
                 "see each arm's notes")


def _served(arm: Arm, target: str, v: support.Version, backend: str, where: str) -> Arm:
    kv = support.cell(target, v, backend, arm.dtype.name, arm.granularity)
    notes = list(arm.notes)
    if kv.effect is support.Effect.IGNORED:
        one = torch.tensor(1.0)
        arm = replace(arm, k={i: one for i in arm.k}, v={i: one for i in arm.v}, q={}, granularity="tensor")
        notes.append(f"as {where} serves it: its scales are ignored ({kv.note}), so this arm runs at scale 1.0")
    elif kv.effect is support.Effect.MAX_OVER_HEADS:
        arm = replace(arm, k={i: s if isinstance(s, str) else s.max().reshape(()) for i, s in arm.k.items()},
                      v={i: s if isinstance(s, str) else s.max().reshape(()) for i, s in arm.v.items()},
                      granularity="tensor")
        notes.append(f"as {where} serves it: one scale per layer, the max over heads ({kv.note})")
    elif kv.effect in (support.Effect.REFUSED, support.Effect.BROKEN):
        notes.append(f"{where} does not serve it: {kv.effect.value} ({kv.note}); not shippable there")
        return replace(arm, shippable=False, notes=tuple(notes))
    if target in _SHARED_KV and kv.effect is support.Effect.APPLIED:
        arm = replace(arm, k=_shared(arm.k, arm.v), v=_shared(arm.v, arm.k))
        notes.append(f"as {where} serves it: shared K/V scale ({_SHARED_KV[target]}), max(k, v) per layer")
    if arm.q:
        q = support.cell(target, v, backend, arm.dtype.name, "q_scale")
        if q.effect is not support.Effect.APPLIED:
            arm = replace(arm, q={})
            notes.append(f"q_scale unused: {q.effect.value} on {where} ({q.note})")
    return replace(arm, notes=tuple(notes))


def _shared(own: dict, other: dict) -> dict:
    """Per layer, max(k, v) of the per-tensor scales where the layer has both (a skipped layer keeps what it has)."""
    return {i: s if isinstance(s, str) or not isinstance(other.get(i), torch.Tensor)
            else torch.maximum(s.max(), other[i].max()).reshape(()) for i, s in own.items()}


def _unserved(arm: Arm, target: str, v: support.Version, backends: Sequence[str], where: str,
              aspects: Sequence[str] = ("tensor",)) -> Arm:
    """`arm`, marked not shippable (kept for comparison, with the matrix's reason) when any of `backends` refuses
    its KV format or accepts it broken in any of `aspects`: advice never names what the stated version cannot run.
    (A skip-layers cell can say "applied" where the cache itself is broken: vLLM 0.32's CPU per-token-head.)"""
    if not arm.shippable:
        return arm
    for b in backends:
        for aspect in aspects:
            cell = support.cell(target, v, b, arm.dtype.name, aspect)
            if cell.effect in (support.Effect.REFUSED, support.Effect.BROKEN):
                note = f"{where} does not serve {arm.dtype.name}: {cell.effect.value} ({cell.note}); not shippable there"
                return replace(arm, shippable=False, notes=arm.notes + (note,))
    return arm


def formats_as_served(arms: Sequence[Arm], target: str | None, version: str | None, emulation: str) -> list[Arm]:
    """Whole-format arms (`--formats`) with a target: an arm whose format the target does not serve at all (refused
    or broken in the support matrix, for the cache itself or its skipped layers) on the backend the evaluation
    stands for, or on the one its advice names (vLLM's Triton backend for the per-token-head caches), is kept for
    comparison but marked not shippable, with the matrix's reason."""
    if target is None:
        return list(arms)
    v = support.version_of(target, version)
    backend = backend_for(target, emulation)
    where = f"{support.ENGINES[target].title} {v}"
    out = []
    for a in arms:
        named = ("triton",) if target == "vllm" and a.dtype.name in support.DYNAMIC_FORMATS else ()
        out.append(_unserved(a, target, v, tuple(dict.fromkeys((backend, *named))), where, ("tensor", "skip_layers")))
    return out
