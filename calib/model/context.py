"""The model's context: the longest sequence, in tokens, that the config declares and that the engine will accept.

Why one home: an evaluation bucket beyond the context is refused before any weight loads, a bucket at the
context is cut so an engine can score it, and the engine's `max_model_len` is capped at it. All three must
agree with the engine, or an arm fails after minutes of work ("prompt longer than max_model_len").

The rule is vLLM's (vllm/config/model.py `_get_and_verify_max_len`, and
vllm/transformers_utils/model_arch_config_convertor.py `derive_max_model_len_and_key`, read at 0.32): the
smallest of the length keys below in the (text) config; `model_max_length` in the config or in
tokenizer_config.json lowers it; a RoPE `factor` multiplies it, except for the types whose
`max_position_embeddings` already holds the scaled length (yarn, llama3, longrope, su, deepseek variants)
and for Gemma 3 (its length is stated scaled).

This module imports neither torch nor transformers: it reads config.json as a dict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib.model.geometry import text_part

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already the scaled length: the factor is not applied again
PRESCALED = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})
UNSET = 10 ** 18       # tokenizers write 1e30 for "no limit"


@dataclass(frozen=True)
class Context:
    """`tokens`: the context; `why`: how it was derived, for error messages (e.g. "max_position_embeddings
    8192" or "max_position_embeddings 32768 x rope factor 4.0")."""
    tokens: int
    why: str


def _rope_parameters(cfg: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Each RoPE parameter set: one, or one per layer type (Gemma 3 style {"full_attention": {...}, ...})."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return
    if rope and all(isinstance(v, Mapping) for v in rope.values()):
        yield from rope.values()
    else:
        yield rope


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < UNSET


def declared(config: Mapping[str, Any], tokenizer_max: Any = None) -> Context | None:
    """The context config.json declares (and the tokenizer's `model_max_length`, when set, caps); None when the
    config states no length."""
    cfg, prefix = text_part(dict(config))
    found = [(int(cfg[k]), f"{prefix}{k} {int(cfg[k])}") for k in LENGTH_KEYS if _positive(cfg.get(k))]
    if not found:
        return None
    tokens, why = min(found)
    if _positive(cfg.get("model_max_length")):           # Command-R style: this key wins over the others
        tokens, why = int(cfg["model_max_length"]), f"{prefix}model_max_length {int(cfg['model_max_length'])}"
    if _positive(tokenizer_max) and int(tokenizer_max) < tokens:
        tokens, why = int(tokenizer_max), f"the tokenizer's model_max_length {int(tokenizer_max)}"
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    if "gemma3" not in model_type:
        factor = 1.0
        for rp in _rope_parameters(cfg):
            kind = rp.get("rope_type") or rp.get("type") or "default"
            if kind not in PRESCALED and _positive(rp.get("factor")):
                factor = float(rp["factor"])
        if factor != 1.0:
            tokens, why = int(tokens * factor), f"{why} x rope factor {factor:g}"
    return Context(tokens, why)


def of_directory(path: Any) -> Context | None:
    """The context of a local model directory from its config.json (and tokenizer_config.json), read before any
    weight loads; None when the directory has no readable config (the model load reports that itself)."""
    src = Path(path)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        tok = json.loads((src / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        tok = None
    return declared(config, tok) if isinstance(config, dict) else None


def of_loaded(config: Any, tokenizer: Any = None) -> Context | None:
    """The context of a loaded model (a transformers config object, and its tokenizer when it has one)."""
    return declared(config.to_dict(), getattr(tokenizer, "model_max_length", None))
