"""What each attention layer keeps in the KV cache: global, sliding-window, chunked-local, or shared with another
layer — read from config.json — and the one bytes model of the cache built on it.

Why: a hybrid model (Gemma 2/3, Mistral-style windows, Llama 4's chunked layers) does not hold the whole context
in every layer. A sliding-window layer holds at most its window, a chunked-local layer at most one chunk, a layer
that reads another layer's KV holds nothing. Counting every layer at the full context overstates the cache, and
understates how cheap it is to keep the windowed layers at the model dtype (vLLM's
`--kv-cache-dtype-skip-layers sliding_window`). Every memory number kvcalib prints comes from `kv_bytes` here.

The kinds come from the config fields each architecture writes (`layer_kinds`, first match wins). A kind kvcalib
does not know (linear attention, Mamba state) is an error naming the field: its bytes are not tokens x heads.

The engine's own reading of capacity (vLLM's hybrid cache manager: `engine_held_tokens`, `engine_layout`,
`engine_capacity_tokens`) reserves more than the window for a sliding layer and counts layers by padded groups;
the user's view (`held_tokens`) is min(length, window). Both use the same per-token bytes.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from calib.model.geometry import GeometryError, text_part
from calib.recipe import dtypes
from calib.safety.readers import raising, whole

GLOBAL, SLIDING, CHUNKED, SHARED = "global", "sliding_window", "chunked_local", "shared"
# vLLM's KV cache spec class per kind (v1/kv_cache_interface.py): how the engine names a group it reports
ENGINE_SPEC_KINDS = {"FullAttentionSpec": GLOBAL, "SlidingWindowSpec": SLIDING, "ChunkedLocalAttentionSpec": CHUNKED}
TYPE_NAMES = {"full_attention": GLOBAL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED}
# bytes per element: the model dtypes' and every whole-byte KV format's (calib.recipe.dtypes)
DTYPE_BYTES = {**dtypes.MODEL_DTYPE_BYTES, **{n: d.bits // 8 for n, d in dtypes.KV_FORMATS.items() if d.bits % 8 == 0}}
LLAMA4_GLOBAL_EVERY = 4      # transformers Llama4TextConfig: no_rope_layers default, every 4th layer global


@dataclass(frozen=True)
class LayerKind:
    """One layer's attention kind; `window` is the sliding window or chunk size in tokens; `source` the layer whose
    KV a shared layer reads."""
    kind: str
    window: int | None = None
    source: int | None = None

    def held_tokens(self, length: int) -> int:
        """Tokens of KV this layer holds for one sequence of `length` tokens (the user's view)."""
        return 0 if self.kind == SHARED else min(length, self.window) if self.window else length


@dataclass(frozen=True)
class Layers:
    """Every attention layer's kind, and which config field said so (`why`)."""
    kinds: tuple[LayerKind, ...]
    why: str

    def of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k.kind == kind)

    @property
    def sliding(self) -> tuple[int, ...]:
        return self.of(SLIDING)

    @property
    def hybrid(self) -> bool:
        """Whether some layer holds less than the whole context (a skip by layer kind is worth measuring)."""
        return any(k.kind != GLOBAL for k in self.kinds)

    def describe(self) -> str:
        parts = []
        for kind in (GLOBAL, SLIDING, CHUNKED, SHARED):
            if idx := self.of(kind):
                wins = sorted({self.kinds[i].window for i in idx if self.kinds[i].window})
                parts.append(f"{len(idx)} {kind}" + (f" (window {', '.join(map(str, wins))})" if wins else ""))
        return ", ".join(parts) + f" ({self.why})"


def _positive(cfg: Mapping[str, Any], key: str, prefix: str, where: str) -> int | None:
    v = cfg.get(key)
    with raising(GeometryError):
        return None if v is None or v is False or v == 0 else whole(v, f"{where}: field '{prefix}{key}'", 1)


def layer_kinds(config: Any, where: str = "config.json") -> Layers:
    """The kind of every layer of a config (config.json's dict or a transformers config); GeometryError (one line,
    naming the field) for kinds that are unknown or disagree with the layer count."""
    raw = config if isinstance(config, Mapping) else config.to_dict()
    cfg, prefix = text_part(dict(raw))
    with raising(GeometryError):
        n = whole(cfg.get("num_hidden_layers", cfg.get("n_layer", cfg.get("num_layers"))),
                  f"{where}: field '{prefix}num_hidden_layers'", 1)
    window = _positive(cfg, "sliding_window", prefix, where)
    chunk = _positive(cfg, "attention_chunk_size", prefix, where)
    model_type = str(cfg.get("model_type") or raw.get("model_type") or "")
    types = cfg.get("layer_types")
    if types is not None:           # transformers writes layer_types for most hybrid architectures
        if not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types):
            raise GeometryError(f"{where}: field '{prefix}layer_types' must list one string per layer "
                                f"({n} layers)")
        if unknown := sorted({t for t in types if t not in TYPE_NAMES}):
            raise GeometryError(f"{where}: field '{prefix}layer_types' holds {unknown[0]!r}: kvcalib knows "
                                f"{', '.join(TYPE_NAMES)} (other layers keep state that is not a KV cache)")
        kinds = [TYPE_NAMES[t] for t in types]
        why = f"{prefix}layer_types"
    elif model_type.startswith("gemma2") and window:
        kinds, why = [SLIDING if i % 2 == 0 else GLOBAL for i in range(n)], "Gemma 2 alternates (even layers sliding)"
    elif (p := _positive(cfg, "sliding_window_pattern", prefix, where)) and window:    # Gemma 3: every n-th global
        kinds, why = [GLOBAL if (i + 1) % p == 0 else SLIDING for i in range(n)], f"{prefix}sliding_window_pattern"
    elif "use_sliding_window" in cfg:       # Qwen2: layers from max_window_layers on slide
        first = cfg.get("max_window_layers")
        on = bool(cfg["use_sliding_window"]) and window is not None
        with raising(GeometryError):
            first = whole(first, f"{where}: field '{prefix}max_window_layers'") if on else first
        kinds = [SLIDING if on and i >= first else GLOBAL for i in range(n)]
        why = f"{prefix}use_sliding_window / max_window_layers"
    elif chunk:                             # Llama 4: every 4th layer global, or no_rope_layers says which
        nope = cfg.get("no_rope_layers")
        if isinstance(nope, list) and len(nope) == n:
            kinds, why = [CHUNKED if x else GLOBAL for x in nope], f"{prefix}no_rope_layers"
        else:
            kinds = [GLOBAL if (i + 1) % LLAMA4_GLOBAL_EVERY == 0 else CHUNKED for i in range(n)]
            why = f"{prefix}attention_chunk_size (every {LLAMA4_GLOBAL_EVERY}th layer global)"
    elif window:                            # Mistral: every layer slides
        kinds, why = [SLIDING] * n, f"{prefix}sliding_window on every layer"
    else:
        kinds, why = [GLOBAL] * n, "no sliding_window, chunk or layer_types field"
    if SLIDING in kinds and window is None:
        raise GeometryError(f"{where}: field '{prefix}layer_types' names sliding layers but "
                            f"'{prefix}sliding_window' is missing")
    if CHUNKED in kinds and chunk is None:
        raise GeometryError(f"{where}: field '{prefix}layer_types' names chunked layers but "
                            f"'{prefix}attention_chunk_size' is missing")
    out = [LayerKind(k, window if k == SLIDING else chunk if k == CHUNKED else None) for k in kinds]
    shared = cfg.get("num_kv_shared_layers")        # Gemma 3n: the last layers read earlier layers' KV
    if shared:
        with raising(GeometryError):
            whole(shared, f"{where}: field '{prefix}num_kv_shared_layers' ({n} layers)", 1, n - 1)
        first = n - shared
        for i in range(first, n):
            # the last earlier layer of the same kind owns the KV (transformers Gemma3n: kv_shared_layer_index)
            src = max((j for j in range(first) if kinds[j] == kinds[i]), default=None)
            if src is None:
                raise GeometryError(f"{where}: field '{prefix}num_kv_shared_layers' = {shared}: layer {i} "
                                    f"({kinds[i]}) has no earlier layer of its kind to share KV with")
            out[i] = LayerKind(SHARED, None, src)
        why += f"; last {shared} layers share KV ({prefix}num_kv_shared_layers)"
    return Layers(tuple(out), why)


# ------------------------------------------------------------------------------------------- bytes model

@dataclass(frozen=True)
class Storage:
    """How one layer stores a token: bytes per element, plus per-token scale bytes per KV head and tensor
    (0 for static per-tensor/per-head scales, which cost a few bytes per layer, not per token)."""
    element_bytes: int
    token_scale_bytes: int = 0


def token_bytes(kv_heads: int, head_dim: int, storage: Storage) -> int:
    """Bytes one token takes in one layer: K and V, every KV head, plus per-token scales."""
    return 2 * kv_heads * (head_dim * storage.element_bytes + storage.token_scale_bytes)


def kv_bytes(layers: Layers, kv_heads: int, head_dim: int, length: int, storage: Mapping[int, Storage]) -> int:
    """Bytes of KV cache one sequence of `length` tokens takes: per layer held tokens x token bytes, each layer at
    its own storage (`storage[i]`; a skipped layer is stored at the model dtype)."""
    return sum(k.held_tokens(length) * token_bytes(kv_heads, head_dim, storage[i])
               for i, k in enumerate(layers.kinds))


def storage_for(n_layers: int, model_dtype: str, kv_dtype: str | None, quantised: Iterable[int],
                token_scale_bytes: int = 0) -> dict[int, Storage]:
    """Per layer storage of an arm: `kv_dtype` (None: the reference) on the `quantised` layers, the model dtype
    elsewhere."""
    if model_dtype not in DTYPE_BYTES or (kv_dtype is not None and kv_dtype not in DTYPE_BYTES):
        raise GeometryError(f"dtype {model_dtype if model_dtype not in DTYPE_BYTES else kv_dtype!r}: the bytes "
                            f"model knows {', '.join(DTYPE_BYTES)}")
    wide = Storage(DTYPE_BYTES[model_dtype])
    narrow = wide if kv_dtype is None else Storage(DTYPE_BYTES[kv_dtype], token_scale_bytes)
    q = set(quantised)
    return {i: narrow if i in q else wide for i in range(n_layers)}


def tokens_per_gib(layers: Layers, kv_heads: int, head_dim: int, length: int, storage: Mapping[int, Storage]) -> float:
    """Context tokens a GiB of cache holds when every sequence is `length` tokens long."""
    return length * 2 ** 30 / kv_bytes(layers, kv_heads, head_dim, length, storage)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def engine_held_tokens(kind: LayerKind, max_model_len: int, in_flight: int, block_size: int) -> int:
    """Tokens vLLM reserves per request for one layer when sizing the pool, in whole blocks (v1/kv_cache_interface.py
    FullAttentionSpec / SlidingWindowSpec / ChunkedLocalAttentionSpec.max_memory_usage_bytes, the same formulas in
    vLLM 0.24 and 0.32; `in_flight` is what the version adds to the window, see vllm_capacity._in_flight_tokens. 0.32's
    SlidingWindowSpec also adds extra_retained_tokens, 0 without speculative decoding)."""
    if kind.kind == SHARED:
        return 0
    if kind.kind == GLOBAL or not kind.window:
        return _cdiv(max_model_len, block_size) * block_size
    if kind.kind == SLIDING:
        return (_cdiv(min(kind.window - 1 + in_flight, max_model_len), block_size) + 1) * block_size
    return _cdiv(min(kind.window + in_flight, max_model_len), block_size) * block_size


@dataclass(frozen=True)
class EngineLayout:
    """How vLLM lays the layers out in its one KV pool: layers of one spec (kind, window, bytes, block size) share a
    block table in groups of `group_size` layers, the last group of a spec padded up to that size; every block id
    stands for one page in each of `group_size` tensors, so a block costs page_bytes x group_size of the pool."""
    groups: tuple[tuple[int, ...], ...]
    group_size: int
    page_bytes: int


def engine_layout(layers: Layers, kv_heads: int, head_dim: int, storage: Mapping[int, Storage],
                  block_sizes: Mapping[int, int]) -> EngineLayout:
    """vLLM's grouping of the layers that keep KV (v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_page_size,
    the same rule in 0.24 and 0.32): the group size is the fewest layers of one spec, or the most when the most is
    under 1.5 x the fewest; a spec of n layers makes cdiv(n, size) groups, group j its layers j, j + groups, ...
    (e.g. 29 sliding layers in groups of 5 make 6 groups, the last of 4 layers padded to 5). `block_sizes[i]`: layer
    i's block size in the engine (vLLM enlarges the blocks of layers with smaller pages so every page has the same
    bytes: unify_kv_cache_spec_page_size); the page is the largest. This is the layer-outer pool every attention
    backend uses by default; vLLM 0.32's block-outer layouts pack mixed page sizes another way
    (_get_packed_kv_cache_groups), which this does not model."""
    specs: dict[tuple[Any, ...], list[int]] = {}
    for i, k in enumerate(layers.kinds):
        if k.kind != SHARED:          # a layer reading another's KV has no cache of its own in vLLM
            specs.setdefault((k.kind, k.window, token_bytes(kv_heads, head_dim, storage[i]), block_sizes[i]),
                             []).append(i)
    counts = [len(v) for v in specs.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for idx in specs.values():
        n = _cdiv(len(idx), size)
        groups += [tuple(idx[j::n]) for j in range(n)]
    page = max(block_sizes[i] * token_bytes(kv_heads, head_dim, storage[i]) for v in specs.values() for i in v)
    return EngineLayout(tuple(groups), size, page)


def engine_capacity_tokens(layers: Layers, kv_heads: int, head_dim: int, storage: Mapping[int, Storage],
                           pool_bytes: int, max_model_len: int, in_flight: int,
                           block_sizes: Mapping[int, int]) -> int:
    """vLLM's `kv_cache_size_tokens` predicted from the bytes model, the engine's way (v1/core/kv_cache_utils.py,
    0.24 and 0.32): the pool makes pool // (page x group size) blocks (get_kv_cache_config_from_groups), a request of
    max_model_len takes each group's reserved tokens in blocks, a padded group as much as a full one
    (get_max_concurrency_for_kv_cache_config), and the capacity is int(blocks / blocks per request x max_model_len)
    (get_kv_cache_capacity). `block_sizes[i]`: layer i's block size in the engine (see `engine_layout`)."""
    lay = engine_layout(layers, kv_heads, head_dim, storage, block_sizes)
    num_blocks = pool_bytes // (lay.page_bytes * lay.group_size)
    per_request = sum(engine_held_tokens(layers.kinds[g[0]], max_model_len, in_flight, block_sizes[g[0]])
                      // block_sizes[g[0]] for g in lay.groups)
    return int(num_blocks / per_request * max_model_len)


def engine_requests_fit(groups: Mapping[str, Any], tokens: int) -> int | None:
    """Requests of `tokens` tokens (prompt and output) the engine's pool holds at once by its own count (vLLM's
    get_max_concurrency_for_kv_cache_config, the maximum concurrency it logs): its blocks over the blocks one
    request reserves in every KV cache group the engine reported (calib/engine/vllm_capacity.kv_groups). On a hybrid
    model this is far fewer than the pool's tokens over `tokens`: the pool counts one group's blocks, and each request
    is held at its longest step (a whole prefill in flight). None where a group's kind is not one vLLM's spec names
    here, or a windowed group needs the tokens in flight and the engine did not say them."""
    per_request, in_flight = 0, groups.get("in_flight_tokens")
    for g in groups["groups"]:
        kind, block = ENGINE_SPEC_KINDS.get(g["spec"]), g["block_size"]
        if kind is None or block <= 0 or (kind != GLOBAL and in_flight is None):
            return None
        per_request += engine_held_tokens(LayerKind(kind, g.get("window")), tokens, in_flight or 0, block) // block
    return groups["num_blocks"] // per_request if per_request else None

