"""What an engine will apply of a checkpoint's KV scales: the checkpoint read as a calibrated result (format,
granularity, q_scale, skipped layers, range, model architecture) and looked up in the support matrix
(calib.recipe.support).

Why beside the loader rules: a checkpoint can pass every loader check and still be served at scale 1.0 (TensorRT-LLM's
FP8 and INT8 caches, SGLang before 0.5.19, with per-head scales, or for a model whose loader drops them).
`kvcalib verify` prints this per engine after the problems, and a result the engine would not serve as calibrated
(INT8 at 1.0, FP8 past its range at 1.0) is an error.
Reads what CheckpointFiles already read; no torch.
"""

from __future__ import annotations

from calib.ckpt import formats
from calib.ckpt.reader import CheckpointFiles, Problem
from calib.recipe import dtypes, support


def read_calibrated(ck: CheckpointFiles, engine: str) -> support.Calibrated | None:
    """The checkpoint as `engine` reads its KV scales; None when it declares no KV format that engine reads."""
    dtype, granularity = None, "tensor"
    if engine == "trtllm":
        inner = formats.modelopt_quantization(ck.hf_quant) if isinstance(ck.hf_quant, dict) else None
        algo = (inner or {}).get("kv_cache_quant_algo")
        served = formats.trtllm_serve_kv_algo(ck.api_options) if ck.api_options_error is None else None
        algo = served if served in ("FP8", "INT8", "NVFP4") else algo   # the serve-time dtype overrides
        dtype = _named(engine, algo)
    else:
        scheme = formats.ct_declared_kv_scheme(ck.inline_qc)
        if isinstance(scheme, dict):
            dtype = {("float", 8): "fp8_e4m3", ("int", 8): "int8"}.get((scheme.get("type"), scheme.get("num_bits")))
            granularity = "head" if scheme.get("strategy") == "attn_head" else "tensor"
        elif formats.modelopt_kv_cache_algo(ck.inline_qc or ck.hf_quant) == "FP8":
            dtype = "fp8_e4m3"
    if dtype is None:
        return None
    q = any(s.kind == "q" for s in ck.scales(ck.files))
    layers = (ck.provenance or {}).get("layers") or {}
    peaks = [max(float(r.get("k_amax", 0)), float(r.get("v_amax", 0))) for r in layers.values() if isinstance(r, dict)]
    ratio = max(peaks) / dtypes.kv_dtype(dtype).qmax if peaks else None
    archs = ck.config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return support.Calibrated(dtype, granularity, q, tuple(sorted(ck.skipped_layers)), ratio, arch)


def _named(engine: str, algo: object) -> str | None:
    """kvcalib's static dtype for the KV algorithm an engine's checkpoint names (None: none kvcalib calibrates)."""
    try:
        d = dtypes.kv_format(str(algo), engine) if algo else None
    except ValueError:
        return None
    return d.name if d is not None and d.name in dtypes.KV_DTYPES else None


def applied(ck: CheckpointFiles, engine: str, version: str | None = None) -> support.Outcome | None:
    """What `engine` (at `version`; None: the newest read) does with `ck`'s scales; None when it reads none."""
    if engine not in support.ENGINES:
        return None
    cal = read_calibrated(ck, engine)
    return None if cal is None else support.outcome(engine, cal, version)


def differs_problem(engine: str, outcome: support.Outcome, problems: list[Problem]) -> Problem | None:
    """A result the engine serves, but not as calibrated (scales at 1.0, one max over heads, q_scale unused), as a
    verify warning, so the count matches the APPLIES lines; None where the result is served as calibrated, refused
    (an error already), or the engine's loader rules already warned about it."""
    if outcome.refused or outcome.severity == support.SAME:
        return None
    if any(p.engine == engine and p.severity == "warning" for p in problems):
        return None
    return Problem(engine, "engine", f"not served as calibrated: {outcome.summary()}", "warning",
                   f"{engine}.applied-differently")


def refusal_problem(engine: str, outcome: support.Outcome) -> Problem:
    """A result the engine would not serve as calibrated, as a verify error naming engine and version."""
    return Problem(engine, "engine", outcome.refusal("State another build with --engine-version if yours applies "
                                                     "them"), code=f"{engine}.not-applied")
