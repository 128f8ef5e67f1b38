"""What each serving engine does with a checkpoint's KV-cache scales: the one support matrix.

Why one module: scales that never reach the kernel are the commonest failure of KV-scale tools, and it is
silent. An engine may apply the scales, apply one max over heads, run at scale 1.0, accept a format it
does not implement, or refuse to start; which one depends on the engine, its version, its attention
backend, the KV format and the granularity. Every command that prints a serve command or a decision
(calibrate, export, verify, eval, tune) reads it from here, so the facts have one home, and each cell
carries where it was read (repository, file, function, version or commit) or the measurement that found it.

Vocabulary: `Effect` is what happens to the scales; a `Cell` is one fact over a version range, a set of
backends, one KV format and one aspect (`tensor` / `head` k/v scales, `q_scale`, `skip_layers`). `effect()`
looks one cell up; `outcome()` says, for a calibrated result, what the engine will do with the file and
whether that makes the served result differ from what was calibrated (and whether a command must refuse);
`markdown()` renders the matrix for the README. Torch-free: the recipe, the exporters and
the CLI import it before anything heavy (it imports only the error base).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from calib.errors import KvcalibError


class Effect(Enum):
    """What an engine does with the scales of one cell."""
    APPLIED = "applied"
    MAX_OVER_HEADS = "applied as max over heads"
    IGNORED = "ignored: runs at 1.0"
    BROKEN = "accepted but broken"
    REFUSED = "refused"


@dataclass(frozen=True)
class Source:
    """A fact read from an engine's source: repository, file, function, and the version or commit read."""
    repo: str
    file: str
    function: str
    version: str

    def cite(self) -> str:
        return f"{self.repo} `{self.file}` `{self.function}` ({self.version})"


@dataclass(frozen=True)
class Measurement:
    """A fact found by running the engine: what was measured, and when."""
    what: str
    date: str

    def cite(self) -> str:
        return f"measured {self.date}: {self.what}"


Evidence = Source | Measurement

# ------------------------------------------------------------------------------------------ versions

# numbers, then at most a PEP 440 pre/post/dev tag (0.11.0rc1, 0.5.18.post1), nothing else: "0.5.18garbage" is a typo
_NUM = re.compile(r"^v?(\d+(?:\.\d+)*)(?:[.-]?(?:a|b|rc|post|dev)\d*)*$")


@dataclass(frozen=True, order=True)
class Version:
    """An engine version: numbers, plus build labels after `+` (e.g. `1.2+pr18953`, a build with that pull
    request). A bare label (`pr18953`) means the engine's current version with that build."""
    numbers: tuple[int, ...]
    builds: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def parse(cls, text: str, default: Version | None = None) -> Version:
        text = str(text).strip().lower()
        base, _, labels = text.partition("+")
        builds = frozenset(x for x in re.split(r"[.+,]", labels) if x)
        m = _NUM.match(base)
        if m:
            nums = tuple(int(x) for x in m.group(1).split("."))
        elif base and default is not None and re.fullmatch(r"[a-z][a-z0-9_-]*", base):
            nums, builds = default.numbers, builds | {base}
        else:
            raise ValueError(f"engine version {text!r}: give numbers like 0.34.0, optionally +BUILD (e.g. 1.2+pr18953)")
        while len(nums) > 1 and nums[-1] == 0:
            nums = nums[:-1]
        return cls(nums, builds)

    def __str__(self) -> str:
        return ".".join(map(str, self.numbers)) + ("+" + "+".join(sorted(self.builds)) if self.builds else "")


def _v(text: str) -> Version:
    return Version.parse(text)


@dataclass(frozen=True)
class Engine:
    name: str                                   # kvcalib's target name
    title: str
    backends: dict[str, str]                    # backend key -> how messages name it
    current: Version                            # the newest version read; the default when none is stated
    read: str                                   # which versions the facts were read from


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("vllm", "vLLM", {"fa3": "FlashAttention-3", "triton": "Triton", "flashinfer": "FlashInfer", "cpu": "CPU"},
           _v("0.34.0"), "vllm 0.24.0, 0.32.0, 0.33.0, 0.34.0 wheels"),
    Engine("trtllm", "TensorRT-LLM", {"pytorch": "PyTorch backend"}, _v("1.2"),
           "NVIDIA/TensorRT-LLM main branch, late 2026 (no calibrated INT8 KV merged)"),
    Engine("sglang", "SGLang", {"cuda": "CUDA", "cpu": "CPU"}, _v("0.5.23"),
           "sglang 0.5.17, 0.5.18, 0.5.19, 0.5.20, 0.5.23 wheels"),
    Engine("trtllm-engine", "TensorRT-LLM (TensorRT engine)", {"tensorrt": "TensorRT-engine backend"}, _v("1.2.1"),
           "NVIDIA/TensorRT-LLM, the 1.2 / 1.3.0rc form that still has the TensorRT backend (removed from main 2026)")
)}

KV_FORMATS = ("fp8_e4m3", "int8", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")
STATIC_FORMATS = ("fp8_e4m3", "int8")          # formats whose scales come from a checkpoint (kvcalib's dtypes)
DYNAMIC_FORMATS = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")
ASPECTS = ("tensor", "head", "q_scale", "skip_layers")

# ------------------------------------------------------------------------------------------ cells


@dataclass(frozen=True)
class Cell:
    """One fact: over versions [since, until) of `engine` (`build`: only builds carrying that label), on
    `backends`, for KV `formats` and `aspects`, the scales get `effect`; `note` says how, in one clause."""
    engine: str
    backends: frozenset[str]
    formats: frozenset[str]
    aspects: frozenset[str]
    effect: Effect
    note: str
    evidence: tuple[Evidence, ...]
    since: Version | None = None
    until: Version | None = None
    build: str | None = None

    def covers(self, version: Version, backend: str, kv_format: str, aspect: str) -> bool:
        return (backend in self.backends and kv_format in self.formats and aspect in self.aspects
                and (self.since is None or version >= self.since) and (self.until is None or version < self.until)
                and (self.build is None or self.build in version.builds))

    def versions(self) -> str:
        lo, hi = self.since, self.until
        text = ("all" if lo is None and hi is None else f">= {lo}" if hi is None else f"< {hi}" if lo is None
                else f"{lo} – <{hi}")
        return text + (f" +{self.build}" if self.build else "")


def _c(engine: str, backends: Iterable[str] | str, formats: Iterable[str] | str, aspects: Iterable[str] | str,
       effect: Effect, note: str, *evidence: Evidence, since: str | None = None, until: str | None = None,
       build: str | None = None) -> Cell:
    def fs(x: Iterable[str] | str, every: Iterable[str]) -> frozenset[str]:
        return frozenset(every) if x == "*" else frozenset([x] if isinstance(x, str) else x)
    return Cell(engine, fs(backends, ENGINES[engine].backends), fs(formats, KV_FORMATS), fs(aspects, ASPECTS), effect,
                note, tuple(evidence), None if since is None else _v(since), None if until is None else _v(until),
                build)


def _vs(file: str, function: str, version: str = "0.24.0-0.34.0") -> Source:
    return Source("vllm-project/vllm", file, function, version)


def _ts(file: str, function: str, version: str = "main, late 2026") -> Source:
    return Source("NVIDIA/TensorRT-LLM", file, function, version)


def _ss(file: str, function: str, version: str = "0.5.23") -> Source:
    return Source("sgl-project/sglang", file, function, version)


_Q = "vllm/model_executor/layers/quantization/"
V1 = _vs(_Q + "kv_cache.py", "BaseKVCacheMethod.process_weights_after_loading", "0.24.0, 0.32.0, 0.34.0")
V2 = _vs(_Q + "compressed_tensors/compressed_tensors.py",
         "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme / process_weights_after_loading")
V3 = _vs("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionBackend.supports_per_head_quant_scales")
V4 = _vs("vllm/model_executor/layers/attention/attention.py", "Attention.__init__ / _init_kv_cache_quant", "0.32.0")
V5 = _vs("vllm/platforms/cuda.py", "CudaPlatform.get_valid_backends")
V6 = _vs("vllm/v1/attention/backends/triton_attn.py", "TritonAttentionBackend.supported_kv_cache_dtypes")
V6F = _vs("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionBackend.supports_kv_cache_dtype")
V6C = _vs("vllm/v1/attention/backends/cpu_attn.py", "CPUAttentionBackend.supported_kv_cache_dtypes")
V7 = _vs("vllm/platforms/cpu.py", "CpuPlatform.get_attn_backend_cls", "0.32.0 (no check), 0.33.0 (check)")
V7K = _vs("vllm/v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl (_k_scale_float)")
V8 = _vs("vllm/config/cache.py", "CacheDType / CacheConfig.kv_cache_dtype_skip_layers", "0.24.0, 0.32.0")
M_CPU = Measurement("CPU vLLM 0.32, SmolLM2-135M, 2 x 512 held-out tokens, prompt log-prob perplexity: BF16 22.4, "
                    "fp8_per_token_head 224,275, int8_per_token_head 270,845; no warning", "2026-12-05")
T1 = _ts("tensorrt_llm/_torch/attention_backend/trtllm.py", "TrtllmAttention.__init__ (kv_cache_scaling_factor = 1)",
         "commit 00bede19 and newest stored")
T2 = _ts("tensorrt_llm/_torch/modules/attention.py", "Attention._attn_impl (kv_scales only if has_fp4_kv_cache)",
         "commit c6d3bb2a")
T3 = _ts("tensorrt_llm/_torch/modules/linear.py", "FP8QDQLinearMethod.load_kv_scales (reshape to [])")
T4 = _ts("tensorrt_llm/_torch/models/modeling_utils.py", "DecoderModelForCausalLM.apply_quant_config_exclude_modules")
T5 = _ts("tensorrt_llm/quantization/modelopt_config.py", "read_modelopt_quant_config / _kv_cache_scheme_to_algo")
T6 = _ts("tensorrt_llm/llmapi/llm_utils.py", "ModelLoader._update_from_hf_quant_config (quant_algo null: "
         "'Pre-quantized checkpoint must have quant_algo.')", "commit 0066b2a5 and the 1.0-1.2 form; run on kvcalib's "
         "outputs 2026-12")
T7 = _ts("tensorrt_llm/_torch/pyexecutor/model_loader.py", "validate_and_set_kv_cache_quant (kv_cache_config.dtype "
         "fp8 | nvfp4 | auto)")
_TE = "1.2 / 1.3.0rc form"
TE1 = _ts("tensorrt_llm/quantization/quantize.py", "kv_cache_quantize (kv_cache_scaling_factor Parameter shape (1,) "
          "float32 on every Attention)", _TE)
TE2 = _ts("tensorrt_llm/models/modeling_utils.py", "preprocess_weights / process_kv_scaling_factor (max(k, v); "
          "kv_cache_rcp_scaling_factor = 1 / scale)", _TE)
TE3 = _ts("tensorrt_llm/models/llama/convert.py", "load_weights_from_hf_model (transformer.layers.{l - "
          "the stage's first layer}.attention.kv_cache_scaling_factor, reshape([1]); INT8: max over q/k/v outputs / 127)", _TE)
TE4 = _ts("tensorrt_llm/models/modeling_utils.py", "PretrainedModel.load ('Required but not provided tensors')", _TE)
TE5 = _ts("(release notes)", "TensorRT backend deprecated in pull request 11723; removed from main in 15918, 16369, "
          "16612", "1.3.0rc20 the last with it")
T_PR = Source("NVIDIA/TensorRT-LLM", "pull request 18953 (open)", "calibrated INT8 KV cache: one "
              "max(k_scale, v_scale) per layer", "unmerged; not verified here")
_SQ = "python/sglang/srt/layers/quantization/"
S1 = _ss(_SQ + "compressed_tensors/compressed_tensors.py",
         "CompressedTensorsConfig.get_quant_method / CompressedTensorsKVCacheMethod.is_supported_scheme",
         "0.5.19, 0.5.23")
S1_OLD = _ss(_SQ + "compressed_tensors/compressed_tensors.py", "CompressedTensorsConfig.get_quant_method "
             "(no KV method for attention)", "0.5.17, 0.5.18")
S2 = _ss("python/sglang/srt/mem_cache/kv_cache_dtype.py", "configure_kv_cache_dtype")
S3 = _ss(_SQ + "kv_cache.py", "BaseKVCacheMethod.process_weights_after_loading")
S4 = _ss("python/sglang/srt/model_loader/weight_utils.py", "maybe_remap_kv_scale_name")
S7 = _ss("python/sglang/srt/models/llama.py", "LlamaForCausalLM._legacy_load_weights (q_scale not in params_dict)")
S8 = _ss("python/sglang/srt/arg_groups/fields/model.py", "kv_cache_dtype choices (no int8, no per-layer KV dtype)")

_CUDA = ("fa3", "triton", "flashinfer")
_NOT_TRITON = ("fa3", "flashinfer")
_DYN = DYNAMIC_FORMATS
_DYN2 = ("fp8_per_token_head", "int8_per_token_head")
_KV = ("tensor", "head", "q_scale")
E = Effect

CELLS: tuple[Cell, ...] = (
    # ---- vLLM: static FP8 e4m3 (compressed-tensors kv_cache_scheme)
    _c("vllm", "*", "fp8_e4m3", "tensor", E.APPLIED, "per-tensor k/v scales reach the kernel", V1, V2, V6),
    _c("vllm", "fa3", "fp8_e4m3", "head", E.APPLIED, "per-head k/v scales applied per head", V2, V3),
    _c("vllm", ("triton", "flashinfer"), "fp8_e4m3", "head", E.REFUSED,
       "backends without per-head scales are dropped: 'No valid attention backend found' without FlashAttention-3",
       V3, V5),
    _c("vllm", "cpu", "fp8_e4m3", "head", E.MAX_OVER_HEADS, "the CPU kernel reads one scale per layer, the max "
       "over heads", V2, V7K),
    _c("vllm", _CUDA, "fp8_e4m3", "q_scale", E.APPLIED, "Q quantized to FP8 with q_scale (per-head q: max over "
       "each KV-head group)", V2, V4),
    _c("vllm", "cpu", "fp8_e4m3", "q_scale", E.IGNORED, "no query quantization on CPU", V4, V7K),
    _c("vllm", "*", "fp8_e4m3", "skip_layers", E.APPLIED, "--kv-cache-dtype-skip-layers keeps the named layers in "
       "the model dtype", V4, V8),
    # ---- vLLM: static INT8 does not exist
    _c("vllm", "*", "int8", "*", E.REFUSED, "no static INT8 KV: the CT scheme raises NotImplementedError and int8 "
       "is no --kv-cache-dtype", V2, V8),
    # ---- vLLM: fp8_e5m2
    _c("vllm", "fa3", "fp8_e5m2", "*", E.REFUSED, "FlashAttention supports FP8 e4m3 only", V6F),
    _c("vllm", ("triton", "flashinfer", "cpu"), "fp8_e5m2", _KV, E.REFUSED, "e5m2 runs at 1.0 by design; a "
       "checkpoint declaring KV scales is refused at start", V1, V4),
    _c("vllm", ("triton", "flashinfer", "cpu"), "fp8_e5m2", "skip_layers", E.APPLIED, "--kv-cache-dtype-skip-layers "
       "keeps the named layers in the model dtype", V4, V8),
    # ---- vLLM: dynamic per-token-head caches (fp8/int8 since 0.24, int4 since 0.32)
    _c("vllm", "*", _DYN2, "*", E.REFUSED, "not a --kv-cache-dtype before 0.24", V8, until="0.24.0"),
    _c("vllm", "*", "int4_per_token_head", "*", E.REFUSED, "not a --kv-cache-dtype before 0.32", V8, until="0.32.0"),
    *(cell_ for formats, since in ((_DYN2, "0.24.0"), (("int4_per_token_head",), "0.32.0")) for cell_ in (
        _c("vllm", "triton", formats, _KV, E.IGNORED, "checkpoint scales set to 1.0; scales computed per token and "
           "head at the cache write", V1, V6, since=since),
        _c("vllm", "triton", formats, "skip_layers", E.APPLIED, "skipped layers stay in the model dtype", V4, V8,
           since=since),
        _c("vllm", _NOT_TRITON, formats, "*", E.REFUSED, "only the Triton backend implements per-token-head caches",
           V6, V6F, since=since),
        _c("vllm", "cpu", formats, _KV, E.BROKEN, "accepted without a check; the CPU kernel treats it as a "
           "quantized cache at 1.0 and returns garbage", V7, *((M_CPU,) if formats == _DYN2 else ()), since=since,
           until="0.33.0"),
        _c("vllm", "cpu", formats, "skip_layers", E.APPLIED, "skipped layers stay in the model dtype (the others "
           "are broken)", V4, V8, since=since, until="0.33.0"),
        _c("vllm", "cpu", formats, "*", E.REFUSED, "'not supported by the CPU attention backend'", V7, since="0.33.0"),
    )),
    # ---- TensorRT-LLM, PyTorch backend (hf_quant_config.json kv_cache_quant_algo)
    _c("trtllm", "*", "fp8_e4m3", ("tensor", "head"), E.IGNORED, "the FP8 cache runs at scale 1.0; scales reach "
       "the kernel only for NVFP4 KV (per-head scales are folded to one scalar); an unquantized model gets FP8 KV "
       "only from the serve-time kv_cache_config.dtype (the LLM API refuses hf_quant_config.json with quant_algo "
       "null)", T1, T2, T3, T6, T7),
    _c("trtllm", "*", "int8", ("tensor", "head"), E.IGNORED, "the INT8 cache runs at scale 1.0 in merged code, and "
       "only under quantized weights (no int8 kv_cache_config.dtype; quant_algo null refused); calibrated INT8 is "
       "only in open pull request 18953", T1, T2, T6, T7, T_PR),
    _c("trtllm", "*", "int8", "tensor", E.APPLIED, "one max(k_scale, v_scale) per layer", T_PR, build="pr18953"),
    _c("trtllm", "*", "int8", "head", E.MAX_OVER_HEADS, "per-head scales folded to one max(k, v) per layer", T_PR, T3,
       build="pr18953"),
    _c("trtllm", "*", ("fp8_e4m3", "int8"), "q_scale", E.IGNORED, "no q_scale is read", T3),
    _c("trtllm", "*", ("fp8_e4m3", "int8"), "skip_layers", E.IGNORED, "not expressible: kv_cache_quant_algo takes "
       "precedence over exclude_modules, every layer is quantized", T4),
    _c("trtllm", "*", ("fp8_e5m2", *_DYN), "*", E.REFUSED, "no such kv_cache_quant_algo (FP8 e4m3, INT8, NVFP4 "
       "only)", T5),
    # ---- TensorRT-LLM, TensorRT-engine backend (a TensorRT-LLM checkpoint: config.json + rank{r}.safetensors)
    _c("trtllm-engine", "*", ("fp8_e4m3", "int8"), "tensor", E.APPLIED, "one kv_cache_scaling_factor per layer, "
       "shared by K and V (max(k, v)): FP8 amax/448, INT8 amax/127; 1.3.0rc1-rc20 too (rc tags are not told apart: "
       "1.3.0 final and later have no TensorRT backend)", TE1, TE2, TE3, since="1.2", until="1.3.1"),
    _c("trtllm-engine", "*", ("fp8_e4m3", "int8"), "head", E.REFUSED, "one scale per layer: per-head scales cannot "
       "be expressed", TE1, TE3, since="1.2", until="1.3.1"),
    _c("trtllm-engine", "*", ("fp8_e4m3", "int8"), "q_scale", E.REFUSED, "no q_scale tensor in the checkpoint",
       TE1, since="1.2", until="1.3.1"),
    _c("trtllm-engine", "*", ("fp8_e4m3", "int8"), "skip_layers", E.REFUSED, "every attention layer gets a "
       "kv_cache_scaling_factor and needs one", TE1, TE4, since="1.2", until="1.3.1"),
    _c("trtllm-engine", "*", ("fp8_e5m2", *_DYN), "*", E.REFUSED, "no such kv_cache_quant_algo", TE1, since="1.2",
       until="1.3.1"),
    _c("trtllm-engine", "*", "*", "*", E.REFUSED, "not read before 1.2: kvcalib's rules are 1.2.x-1.3.0rc20's",
       TE1, until="1.2"),
    _c("trtllm-engine", "*", "*", "*", E.REFUSED, "the TensorRT backend is removed (last in 1.3.0rc20)", TE5,
       since="1.3.1"),
    # ---- SGLang
    _c("sglang", "*", "fp8_e4m3", "tensor", E.APPLIED, "static per-tensor FP8 scales of a compressed-tensors "
       "kv_cache_scheme load (--kv-cache-dtype auto resolves to fp8_e4m3)", S1, S2, S3, since="0.5.19"),
    _c("sglang", "*", "fp8_e4m3", "tensor", E.IGNORED, "no KV method for compressed-tensors before 0.5.19: the "
       "scales are 'not loaded'", S1_OLD, S4, until="0.5.19"),
    _c("sglang", "*", "fp8_e4m3", "head", E.IGNORED, "'only static symmetric per-tensor FP8 scales are supported': "
       "per-head schemes are dropped with a warning", S1, S2),
    _c("sglang", "*", ("fp8_e4m3", "fp8_e5m2"), "q_scale", E.IGNORED, "q_scale is not a parameter ('not found in "
       "params_dict')", S4, S7),
    _c("sglang", "*", ("fp8_e4m3", "fp8_e5m2"), "skip_layers", E.IGNORED, "no per-layer KV dtype option: every "
       "layer is quantized", S8),
    _c("sglang", "cuda", "fp8_e5m2", ("tensor", "head"), E.IGNORED, "accepted; the compressed-tensors KV method "
       "resolves float8 schemes to e4m3 only, so e5m2 runs at 1.0", S1, S2),
    _c("sglang", "cpu", "fp8_e5m2", ("tensor", "head"), E.REFUSED, "fp8_e5m2 is refused on CPU", S2),
    _c("sglang", "*", ("int8", *_DYN), "*", E.REFUSED, "not a --kv-cache-dtype choice", S8),
)


class SupportError(KvcalibError, LookupError):
    """A lookup outside the matrix: unknown engine, backend, format or aspect (the message names the choices)."""


def engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise SupportError(f"unknown engine {name!r}; the support matrix knows {sorted(ENGINES)}") from None


def version_of(name: str, version: str | Version | None) -> Version:
    """`version` parsed (None: the newest version read for that engine)."""
    e = engine(name)
    if version is None:
        return e.current
    return version if isinstance(version, Version) else Version.parse(version, default=e.current)


def cell(engine_name: str, version: str | Version | None, backend: str, kv_format: str, aspect: str) -> Cell:
    """The one cell for this engine version, backend, KV format and aspect (a build-specific cell wins)."""
    e = engine(engine_name)
    for what, value, choices in (("backend", backend, e.backends), ("KV format", kv_format, KV_FORMATS),
                                 ("granularity", aspect, ASPECTS)):
        if value not in choices:
            raise SupportError(f"{e.title}: unknown {what} {value!r}; the matrix knows {list(choices)}")
    v = version_of(engine_name, version)
    found = [c for c in CELLS if c.engine == engine_name and c.covers(v, backend, kv_format, aspect)]
    built = [c for c in found if c.build]
    found = built or found
    if len(found) != 1:
        raise SupportError(f"{e.title} {v} {backend} {kv_format} {aspect}: {len(found)} cells match (the matrix "
                           "must have exactly one)")
    return found[0]


def effect(engine_name: str, version: str | Version | None, backend: str, kv_format: str, aspect: str) -> Effect:
    """What `engine_name` at `version` on `backend` does with `aspect` scales of a `kv_format` cache."""
    return cell(engine_name, version, backend, kv_format, aspect).effect


# ------------------------------------------------------------------------------------------ a calibrated result

SAME, DIFFERS, REFUSE = "same", "differs", "refuse"
_RANK = {SAME: 0, DIFFERS: 1, REFUSE: 2}


@dataclass(frozen=True)
class Calibrated:
    """What kvcalib calibrated: KV dtype, granularity (tensor | head), q_scale, skipped layers, and the
    largest amax / qmax over layers (> 1: some K or V value lies past the format's range at scale 1.0;
    None: not known)."""
    dtype: str
    granularity: str = "tensor"
    q_scale: bool = False
    skip_layers: tuple[int | str, ...] = ()
    amax_ratio: float | None = None


@dataclass(frozen=True)
class Consequence:
    """What one engine (version, backend) does with a calibrated result: the cells read, the severity
    (`same` as calibrated, `differs`, or `refuse`: a command must not hand the user this file for this
    engine) and one line per thing that differs."""
    engine: str
    version: Version
    backend: str
    cells: tuple[Cell, ...]
    severity: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    """A calibrated result on one engine version over the backends asked (all when none was named)."""
    engine: str
    version: Version
    per_backend: tuple[Consequence, ...]
    calibrated: Calibrated

    @property
    def refused(self) -> bool:
        """Refuse only when no backend serves the result as calibrated or close enough."""
        return all(c.severity == REFUSE for c in self.per_backend)

    @property
    def severity(self) -> str:
        return REFUSE if self.refused else max((c.severity for c in self.per_backend if c.severity != REFUSE),
                                               key=_RANK.__getitem__, default=SAME)

    def lines(self) -> list[str]:
        """One line per distinct consequence, naming the backends it holds on (when the engine has several)."""
        e = ENGINES[self.engine]
        groups: dict[str, list[str]] = {}
        for c in self.per_backend:
            for line in c.lines:
                groups.setdefault(line, []).append(c.backend)
        out = []
        for line, backends in groups.items():
            where = "" if len(e.backends) == 1 or len(backends) == len(e.backends) else \
                " (" + ", ".join(e.backends[b] for b in backends) + ")"
            out.append(f"{e.title} {self.version}{where}: {line}")
        return out

    def summary(self) -> str:
        """One line: what the engine does with the file, for a serve command or a decision."""
        lines = self.lines()
        if lines:
            return "; ".join(lines)
        return f"{ENGINES[self.engine].title} {self.version}: the scales are applied as calibrated"

    def refusal(self, what_instead: str = "") -> str:
        """The one-line refusal: engine, version, why, and what to do instead."""
        why = "; ".join(dict.fromkeys(line for c in self.per_backend for line in c.lines))
        return f"{ENGINES[self.engine].title} {self.version} would not serve these scales: {why}" + (
            f". {what_instead}" if what_instead else "")


def _consequence(name: str, v: Version, backend: str, cal: Calibrated) -> Consequence:
    kv = cell(name, v, backend, cal.dtype, cal.granularity)
    cells, lines, sev = [kv], [], SAME

    def bump(s: str) -> None:
        nonlocal sev
        sev = max(sev, s, key=_RANK.__getitem__)

    what = f"{cal.dtype} {cal.granularity} scales"
    if kv.effect in (E.REFUSED, E.BROKEN):
        lines.append(f"{what} {kv.effect.value} ({kv.note})")
        bump(REFUSE)
    elif kv.effect is E.IGNORED:
        if cal.dtype in DYNAMIC_FORMATS:
            lines.append(f"{what} unused ({kv.note})")
            bump(DIFFERS)
        elif cal.dtype == "int8":
            lines.append(f"{what} ignored, INT8 runs at scale 1.0 ({kv.note}): every K/V value is rounded to an "
                         "integer")
            bump(REFUSE)
        elif cal.amax_ratio is not None and cal.amax_ratio > 1:
            lines.append(f"{what} ignored, the cache runs at scale 1.0 ({kv.note}) and K/V values up to "
                         f"{cal.amax_ratio:.3g}x the {cal.dtype} range saturate")
            bump(REFUSE)
        else:
            inside = ("; no K/V value lies past the range, so it behaves like the default scale"
                      if cal.amax_ratio is not None else "")
            lines.append(f"{what} ignored, the cache runs at scale 1.0 ({kv.note}){inside}")
            bump(DIFFERS)
    elif kv.effect is E.MAX_OVER_HEADS:
        lines.append(f"{what} applied as one max over heads per layer ({kv.note})")
        bump(DIFFERS)
    if cal.q_scale:
        q = cell(name, v, backend, cal.dtype, "q_scale")
        cells.append(q)
        if q.effect is not E.APPLIED and kv.effect not in (E.REFUSED, E.BROKEN):
            lines.append(f"q_scale {q.effect.value} ({q.note})")
            bump(DIFFERS)
    if cal.skip_layers:
        s = cell(name, v, backend, cal.dtype, "skip_layers")
        cells.append(s)
        if s.effect is not E.APPLIED and kv.effect not in (E.REFUSED, E.BROKEN):
            lines.append(f"skip_layers {list(cal.skip_layers)} {s.effect.value} ({s.note})")
            bump(REFUSE)
    return Consequence(name, v, backend, tuple(cells), sev, tuple(lines))


def outcome(engine_name: str, cal: Calibrated, version: str | Version | None = None,
            backend: str | Sequence[str] | None = None) -> Outcome:
    """What `engine_name` (at `version`; None: the newest read) does with `cal`, on `backend` (None: each)."""
    e = engine(engine_name)
    v = version_of(engine_name, version)
    backends = list(e.backends) if backend is None else [backend] if isinstance(backend, str) else list(backend)
    return Outcome(engine_name, v, tuple(_consequence(engine_name, v, b, cal) for b in backends), cal)


def who_serves(kv_format: str, granularity: str = "tensor") -> str:
    """One sentence: which engines (newest versions read) serve calibrated `kv_format` scales as calibrated, which
    run them differently, and which refuse — for advice that must not name an engine that ignores the scales."""
    groups: dict[str, list[str]] = {}
    for name, e in ENGINES.items():
        o = outcome(name, Calibrated(kv_format, granularity))
        at_one = any(c.cells[0].effect is E.IGNORED for c in o.per_backend)
        key = "applied" if o.severity == SAME else ("at_one" if at_one else "refused") if o.refused else "differs"
        groups.setdefault(key, []).append(f"{e.title} {o.version}")
    parts = []
    if groups.get("applied"):
        parts.append(f"applied as calibrated by {', '.join(groups['applied'])}")
    if groups.get("differs"):
        parts.append(f"served differently by {', '.join(groups['differs'])}")
    if groups.get("at_one"):
        parts.append(f"run at scale 1.0 by {', '.join(groups['at_one'])}")
    if groups.get("refused"):
        parts.append(f"not served by {', '.join(groups['refused'])}")
    builds = sorted({f"{ENGINES[c.engine].title} +{c.build}" for c in CELLS if c.build and kv_format in c.formats
                     and granularity in c.aspects and c.effect in (E.APPLIED, E.MAX_OVER_HEADS)})
    text = f"calibrated {kv_format} KV scales are " + "; ".join(parts)
    return text + (f" (applied by a build: {', '.join(builds)})" if builds else "")


# Skipping by layer kind: vLLM's --kv-cache-dtype-skip-layers takes layer indices and attention type names; the name
# `sliding_window` keeps every layer built with a sliding window at the model dtype (vLLM 0.32
# model_executor/layers/attention/attention.py Attention.__init__; pull request 33695, read in 0.24.0 and 0.32.0).
# Chunked-local layers have no sliding window there, so no kind name covers them: they are skipped by index.
SKIP_KINDS = {"vllm": ("sliding_window",)}


def skip_order(items: Iterable[int | str]) -> list[int | str]:
    """A skip list in one order whatever order it was built in: layer numbers ascending, then kind names. The flag
    takes both, and Python cannot sort a number against a name; a list that names a kind and numbers layers (a
    checkpoint's own skips on a hybrid model) must still give one key, one engine start and one flag per set."""
    seen = set(items)
    names = sorted(i for i in seen if isinstance(i, str))
    return [*sorted(i for i in seen if not isinstance(i, str)), *names]


def skip_by_kind(engine_name: str, kind: str = "sliding_window") -> str | None:
    """None when `engine_name` keeps layers of `kind` at the model dtype by name; else the one line saying it
    cannot, and what it can do instead (from the skip_layers cell of the support matrix)."""
    e = engine(engine_name)
    if kind in SKIP_KINDS.get(engine_name, ()):
        return None
    c = cell(engine_name, None, next(iter(e.backends)), "fp8_e4m3", "skip_layers")
    if c.effect is E.APPLIED:
        return (f"{e.title} cannot name {kind} layers in its skip option; they are exported as layer indices "
                f"({c.note})")
    return f"{e.title} cannot keep {kind.replace('_', '-')} layers at the model dtype: {c.note}"


# ------------------------------------------------------------------------------------------ the README table


def markdown() -> str:
    """The matrix as a markdown table, one row per cell, its sources numbered in a list under the table."""
    def names(keys: frozenset[str], order: Sequence[str], label: dict[str, str] | None = None) -> str:
        if len(keys) == len(order):
            return "all"
        return ", ".join((label or {}).get(k, k) for k in order if k in keys)

    refs: dict[Evidence, int] = {}
    rows = ["| engine | versions | backend | KV format | scales | effect | what happens | source |",
            "|---|---|---|---|---|---|---|---|"]
    for c in CELLS:
        e = ENGINES[c.engine]
        nums = " ".join(f"[{refs.setdefault(x, len(refs) + 1)}]" for x in c.evidence)
        rows.append(f"| {e.title} | {c.versions()} | {names(c.backends, list(e.backends), e.backends)} "
                    f"| {names(c.formats, KV_FORMATS)} | {names(c.aspects, ASPECTS)} "
                    f"| **{c.effect.value}** | {c.note.replace('|', '/')} | {nums} |")
    read = "; ".join(f"{e.title}: {e.read}" for e in ENGINES.values())
    cites = [f"{n}. {x.cite()}" for x, n in refs.items()]
    return "\n".join([*rows, "", f"Read from: {read}.", "", *cites]) + "\n"


__all__ = ["ASPECTS", "CELLS", "Calibrated", "Cell", "Consequence", "DIFFERS", "DYNAMIC_FORMATS", "ENGINES", "Effect",
           "Engine", "KV_FORMATS", "Measurement", "Outcome", "REFUSE", "SAME", "STATIC_FORMATS", "Source",
           "SKIP_KINDS", "SupportError", "Version", "cell", "effect", "engine", "markdown", "outcome", "skip_by_kind",
           "version_of", "who_serves"]


if __name__ == "__main__":      # `python -m calib.engine.support`: the README's table
    print(markdown(), end="")
