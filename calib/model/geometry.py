"""Refuse a config.json that describes an impossible attention geometry, before any weight is read.

Why from the raw JSON, before transformers sees it: a config class divides `hidden_size` by
`num_attention_heads` in its constructor (a zero is a ZeroDivisionError, not a message), and a model built
from an impossible geometry either crashes mid-forward or, worse, runs with reshapes that scramble heads.
Values far beyond any real model (an extra zero typed into `hidden_size`) would make transformers allocate
terabytes for weights that the files do not hold. Every error names config.json, the field and the value.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any

from calib.errors import KvcalibError
from calib.safety.readers import number, raising

# field -> (aliases older architectures use, upper bound). Bounds sit far above any released model.
SIZES: dict[str, tuple[tuple[str, ...], int]] = {
    "num_hidden_layers": (("n_layer", "num_layers"), 4096),
    "num_attention_heads": (("n_head",), 16384),
    "num_key_value_heads": ((), 16384),
    "hidden_size": (("n_embd", "d_model"), 1 << 20),
    "head_dim": ((), 1 << 16),
    "vocab_size": ((), 1 << 25),
    "max_position_embeddings": (("n_positions",), 1 << 31),
    "sliding_window": ((), 1 << 31),
}
ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling")


class GeometryError(KvcalibError, ValueError):
    """config.json describes a model that cannot exist; the message names the field and value."""


def text_part(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The dict holding the language model's fields (multimodal configs nest it) and its key prefix."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = config.get(key)
        if isinstance(inner, dict):
            return inner, f"{key}."
    return config, ""


def check(config: dict[str, Any], where: str) -> None:
    """Raise GeometryError for impossible sizes; `where` names the file (e.g. "MODEL m/config.json")."""
    if not isinstance(config, dict):
        raise GeometryError(f"{where} must hold a JSON object")
    cfg, prefix = text_part(config)

    def fail(msg: str) -> GeometryError:
        return GeometryError(f"{where}: {msg}; config.json does not describe a model that can exist — fix it or "
                             "use the model's original config.json")

    values: dict[str, int] = {}
    for name, (aliases, top) in SIZES.items():
        # the key actually used (the field or its alias) and its value; None when absent
        key, v = next(((k, cfg[k]) for k in (name, *aliases) if cfg.get(k) is not None), (name, None))
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            if name == "sliding_window" and v in (0, False):  # some configs write 0 for "no window"
                continue
            raise fail(f"field '{prefix}{key}' = {v!r} must be a positive integer")
        if v > top:
            raise fail(f"field '{prefix}{key}' = {v} is beyond any real model (at most {top:,})")
        values[name] = v

    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise fail(f"field '{prefix}num_attention_heads' = {heads} is not a multiple of "
                   f"'{prefix}num_key_value_heads' = {kv} (each KV head serves a whole group of query heads)")
    hidden, head_dim = values.get("hidden_size"), values.get("head_dim")
    if heads and hidden and head_dim is None and hidden % heads:
        raise fail(f"field '{prefix}hidden_size' = {hidden} is not divisible by '{prefix}num_attention_heads' = "
                   f"{heads}, and no head_dim is given")
    head_dim = head_dim or (hidden // heads if heads and hidden else None)

    layers = values.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise fail(f"field '{prefix}layer_types' must be a list of strings")
        if layers is not None and len(types) != layers:
            raise fail(f"field '{prefix}layer_types' has {len(types)} entries but '{prefix}num_hidden_layers' = "
                       f"{layers}")

    factor = cfg.get("partial_rotary_factor")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor", factor) if factor is None else factor
    with raising(fail):
        number(factor, f"field '{prefix}partial_rotary_factor'", 0, 1, above=True, null=True)
        number(cfg.get("rope_theta", rope.get("rope_theta")), f"field '{prefix}rope_theta'", 0, above=True, null=True)
    uses_rope = any(cfg.get(k) is not None for k in ROPE_KEYS)
    if uses_rope and head_dim is not None:
        rot = int(head_dim * (factor or 1.0))
        if rot < 2 or rot % 2:
            raise fail(f"RoPE rotates {rot} channels of each head (head_dim {head_dim} × partial_rotary_factor "
                       f"{factor or 1.0}); it rotates channel pairs, so this must be an even number >= 2")
