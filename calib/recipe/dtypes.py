"""The recipe's typed vocabulary, torch-free: KV-cache formats and range observers as registered values.

Why one module without torch: the recipe validates against these registries before anything heavy is
imported (the CLI's `--help` and choices come from them too), and the stages that do import torch —
capture (calib.capture.spec, calib.capture.observers), scales, export, emulation — look the same values up instead of
comparing strings. Granularities are the third registry (calib.recipe.granularity, also torch-free).

Every fact about one KV format lives on its `KVDtype`: range (qmax), storage (bits, per-token scale bytes),
the short name tune prints, the float type its cache rounds through, and, per engine, the names that engine
gives it, the first version that has it and the attention backend it needs (`Served`). An engine missing from
`engines` has no such cache: the support matrix (calib.recipe.support) refuses the format there, the engine's
target does not accept it, its serve command has no flag for it. Adding a static format is one entry here
plus what each engine that has it does with its scales (calib.recipe.support.engines).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- KV-cache formats

STATIC, UNSCALED, PER_TOKEN_HEAD = "static", "unscaled", "per_token_head"


@dataclass(frozen=True)
class Served:
    """How one engine knows a KV format: its names for it (the first is the one kvcalib writes or passes; the
    others are accepted when read back), the first version that has it (None: every version read), and the
    attention backend it needs there (`backend`: everywhere; `cuda_backend`: on CUDA only; vLLM's names)."""
    names: tuple[str, ...]
    since: str | None = None
    backend: str | None = None
    cuda_backend: str | None = None


@dataclass(frozen=True)
class KVDtype:
    """A KV-cache storage type: its name, the largest magnitude it represents, how it is stored, and which
    engines have it.

    `scaling`: `static` (scales from a checkpoint: what kvcalib calibrates), `unscaled` (always scale 1.0),
    `per_token_head` (the engine computes one float32 scale per token and KV head at the cache write and stores
    it beside the values: `scale_bytes` per K or V vector). `bits`: storage bits per element (INT4 packs two per
    byte). `short`: the name tune's candidates print. `cast`: the torch float type the cache rounds through
    (None: integers, round half to even). `engines`: {engine: Served}; an engine not listed has no such cache."""
    name: str
    qmax: float
    bits: int = 8
    scaling: str = STATIC
    scale_bytes: int = 0
    short: str = ""
    cast: str | None = None
    engines: Mapping[str, Served] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def dynamic(self) -> bool:
        return self.scaling == PER_TOKEN_HEAD

    @property
    def element_bytes(self) -> float:
        """Cache bytes per stored element (INT4: 0.5)."""
        return self.bits / 8

    def served(self, engine: str) -> Served | None:
        """How `engine` knows this format; None: it has no such cache."""
        return self.engines.get(engine)

    def cache_name(self, engine: str) -> str | None:
        """The name `engine` gives this format (its --kv-cache-dtype value, or its checkpoint's KV algorithm);
        None: the engine has no such cache."""
        s = self.engines.get(engine)
        return s.names[0] if s else None

    @property
    def engine(self) -> str | None:
        """vLLM's --kv-cache-dtype name for it (None: vLLM has no such cache)."""
        return self.cache_name("vllm")

    def bytes_per_token(self, kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> float:
        """Cache bytes one token takes in one attention layer: K and V of every KV head, plus the per-token
        scales. vLLM's Triton backend packs them the same way (vllm/v1/attention/backends/triton_attn.py
        `TritonAttentionBackend.customize_spec`: (hs_k + hs_v) * element size + 2 float32 scales per head,
        INT4 halving the head sizes)."""
        dims = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        return kv_heads * (dims * self.bits / 8 + 2 * self.scale_bytes)


# The engines' names (the support matrix cites where each is read). vLLM: --kv-cache-dtype (`fp8` and `fp8_e4m3`
# name the same cache); SGLang: --kv-cache-dtype; TensorRT-LLM and its TensorRT-engine backend: the checkpoint's
# kv_cache_quant_algo. vLLM's per-token-head caches need its Triton backend; on CUDA only its FlashInfer backend
# keeps fp8_e5m2 as e5m2 (FLASH_ATTN takes FP8 as e4m3 only, TRITON_ATTN views a static FP8 cache as e4m3).
_TRITON = "TRITON_ATTN"
FP8_E4M3 = KVDtype("fp8_e4m3", 448.0, short="fp8", cast="float8_e4m3fn", engines={
    "vllm": Served(("fp8", "fp8_e4m3")), "sglang": Served(("fp8_e4m3",)), "trtllm": Served(("FP8",)),
    "trtllm-engine": Served(("FP8",))})
INT8 = KVDtype("int8", 127.0, short="int8", engines={"trtllm": Served(("INT8",)), "trtllm-engine": Served(("INT8",))})
FP8_E5M2 = KVDtype("fp8_e5m2", 57344.0, scaling=UNSCALED, short="e5m2", cast="float8_e5m2", engines={
    "vllm": Served(("fp8_e5m2",), cuda_backend="FLASHINFER"), "sglang": Served(("fp8_e5m2",))})
# the dynamic caches: qmax as the kernel's QUANT_MAX (INT4: 15 steps of an asymmetric [min, max] range)
FP8_PER_TOKEN_HEAD = KVDtype("fp8_per_token_head", 448.0, scaling=PER_TOKEN_HEAD, scale_bytes=4, short="fp8/tok",
                             cast="float8_e4m3fn",
                             engines={"vllm": Served(("fp8_per_token_head",), since="0.20", backend=_TRITON)})
INT8_PER_TOKEN_HEAD = KVDtype("int8_per_token_head", 127.0, scaling=PER_TOKEN_HEAD, scale_bytes=4, short="int8/tok",
                              engines={"vllm": Served(("int8_per_token_head",), since="0.20", backend=_TRITON)})
INT4_PER_TOKEN_HEAD = KVDtype("int4_per_token_head", 15.0, bits=4, scaling=PER_TOKEN_HEAD, scale_bytes=4,
                              short="int4/tok",
                              engines={"vllm": Served(("int4_per_token_head",), since="0.25", backend=_TRITON)})
# Every KV format kvcalib knows (evaluation arms); KV_DTYPES: the ones a recipe calibrates (static scales).
KV_FORMATS: dict[str, KVDtype] = {d.name: d for d in (FP8_E4M3, INT8, FP8_E5M2, FP8_PER_TOKEN_HEAD,
                                                      INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD)}
KV_DTYPES: dict[str, KVDtype] = {n: d for n, d in KV_FORMATS.items() if d.scaling == STATIC}
MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_dtype(name: str) -> KVDtype:
    """The KV dtype called `name`; ValueError naming the accepted ones otherwise."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; accepted: {sorted(KV_DTYPES)}") from None


def kv_format(name: str, engine: str | None = None) -> KVDtype:
    """Any KV format called `name` (static, unscaled or dynamic) — kvcalib's name, or the name `engine` gives it
    (any engine's when None and only one format answers, e.g. vLLM's `fp8`); ValueError naming the accepted ones."""
    if name in KV_FORMATS:
        return KV_FORMATS[name]
    found = {d.name: d for d in KV_FORMATS.values() for e, s in d.engines.items()
             if (engine is None or e == engine) and name in s.names}
    if len(found) == 1:
        return next(iter(found.values()))
    names = sorted(n for d in KV_FORMATS.values() for e, s in d.engines.items() if engine in (None, e)
                   for n in s.names)
    raise ValueError(f"unknown KV format {name!r}; accepted: {sorted(KV_FORMATS)}, or an engine's name for one: "
                     f"{', '.join(dict.fromkeys(names))}")


def for_engine(engine: str, formats: Mapping[str, KVDtype] = KV_DTYPES) -> tuple[KVDtype, ...]:
    """The formats of `formats` (the static ones unless told) `engine` has, in registry order."""
    return tuple(d for d in formats.values() if engine in d.engines)


def model_bytes_per_token(model_dtype: str, kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> float:
    """Cache bytes per token per layer of the reference: K and V in the model's dtype."""
    dims = head_dim + (head_dim if v_head_dim is None else v_head_dim)
    return kv_heads * dims * MODEL_DTYPE_BYTES[model_dtype.removeprefix("torch.")]


# ---------------------------------------------------------------- observers

def is_int(v: Any) -> bool:
    """An int, never a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


MSE_GRID_MAX = 4096          # candidate clips per head: the search holds [grid, bins] values at once
HISTOGRAM_BINS = 2048        # the histogram observers' resolution (calib.capture.observers)


@dataclass(frozen=True)
class Param:
    """One observer parameter: its type, the values accepted, and whether a recipe may set it."""
    kind: type                                   # int or float (ints are accepted for floats)
    check: Callable[[Any], bool]
    want: str                                    # what `check` accepts, for error messages
    recipe: bool = True                          # False: the observer takes it, a recipe may not (see why_fixed)
    why_fixed: str = ""


# A recipe never sets the histogram's bin count: statistics files merge (and resume) only at one resolution,
# and the recorded recipe is what identifies them; tests and tools may build observers at another.
_BINS = Param(int, lambda v: is_int(v) and 256 <= v <= 1 << 15 and not v & (v - 1),
              "a power of two in [256, 32768]", recipe=False,
              why_fixed=f"the histogram resolution is fixed at {HISTOGRAM_BINS} bins so that statistics files merge")


@dataclass(frozen=True)
class ObserverSpec:
    """A range observer as a recipe names it: its parameters, and what it needs from the capture."""
    name: str
    params: dict[str, Param] = field(default_factory=dict)
    exact: bool = False          # the exact max |x| (every capture records it anyway: no observer object needed)
    k_only: bool = False         # applies to K only (V keeps the exact max); needs the model's rotary layout

    def recipe_params(self) -> dict[str, Param]:
        return {k: p for k, p in self.params.items() if p.recipe}


OBSERVERS: dict[str, ObserverSpec] = {s.name: s for s in (
    ObserverSpec("absmax", exact=True),
    ObserverSpec("percentile", {"p": Param(float, lambda v: _is_num(v) and 0 < v <= 100, "a number in (0, 100]"),
                                "bins": _BINS}),
    ObserverSpec("mse", {"grid": Param(int, lambda v: is_int(v) and 2 <= v <= MSE_GRID_MAX,
                                       f"an integer in [2, {MSE_GRID_MAX}]"),
                         "min_ratio": Param(float, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
                         "bins": _BINS}),
    ObserverSpec("rope_bound", k_only=True),
)}


def observer(name: str) -> ObserverSpec:
    """The observer called `name`; ValueError naming the accepted ones otherwise."""
    try:
        return OBSERVERS[name]
    except KeyError:
        raise ValueError(f"unknown observer {name!r}; accepted: {sorted(OBSERVERS)}") from None
