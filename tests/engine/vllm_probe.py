"""Load a checkpoint in real vLLM with an FP8 KV cache and report what the engine actually uses.

Runs in the vLLM venv only, never in kvcalib's own environment: it imports nothing from `calib`.

    python tests/engine/vllm_probe.py CKPT OUT.json [--max-tokens N] [--kv-cache-dtype fp8|bfloat16|fp8-or-bfloat16]

OUT.json receives
    {"scales": {"<layer>": [k_scale, v_scale]},          # the floats the attention kernels are given
     "layers": {"<layer>": {...}},                         # scale buffers, q scale and cache dtype per layer
     "kv_cache_dtype": "fp8",                              # the engine-wide cache dtype
     "fp8_kv_unsupported": null,                           # or why this host cannot hold an FP8 cache
     "model_dtype": "bfloat16",
     "kv_cache_dtype_skip_layers": {"passed": [...], "engine": [...]},
     "generated_token_ids": [...], "prompt": ...}

Layers named in the checkpoint's kvcalib.json `skipped_layers` are passed to vLLM as
`kv_cache_dtype_skip_layers`, as `kvcalib calibrate` tells users to serve such a checkpoint.

vLLM runs the model in a separate engine process, so the functions handed to `LLM.apply_model` must
be importable there by module name: that is why they live at the top level of this module and why
`main` puts this directory on PYTHONPATH before vLLM starts.

Why a BF16 fallback: vLLM's CPU build refuses an FP8 cache on x86 hosts without AVX-512 or AMX (its
attention backend raises NotImplementedError while allocating the cache). The scale-loading path does not
depend on the cache dtype: the compressed-tensors KV-cache method reads the checkpoint's k/v/q scales into
the attention layers and sets the floats the kernels would use either way. So on such a host
(`--kv-cache-dtype fp8-or-bfloat16`, the default) the probe asks vLLM itself whether FP8 is possible, and
if not it starts the engine with the model-dtype cache and reports vLLM's reason in `fp8_kv_unsupported`;
the tests that need an FP8 cache then skip with that reason (or fail under `--require fp8-kv`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
_PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."
_PROMPT_IDS = [1, 17, 42, 99, 123, 7, 256, 300]


def _attention_layers(model):
    """Yield (layer_index, module) for every attention layer that holds KV-cache scales."""
    seen = {}
    for name, module in model.named_modules():
        # vLLM's Attention/MLAAttention carry `_k_scale_float` (what the kernels read) and `kv_cache_dtype`.
        if not (hasattr(module, "_k_scale_float") and hasattr(module, "kv_cache_dtype")):
            continue
        match = _LAYER_RE.search(name)
        if match is None:
            raise RuntimeError(f"attention module {name!r} has no layer index in its name")
        index = int(match.group(1))
        if index in seen:
            raise RuntimeError(f"two attention modules for layer {index}: {seen[index]!r} and {name!r}")
        seen[index] = name
        yield index, module


def read_kv_scales(model) -> dict[int, tuple[float, float]]:
    """`apply_model` target: {layer_index: (k_scale, v_scale)} as the attention kernels receive them."""
    return {
        index: (float(module._k_scale_float), float(module._v_scale_float))
        for index, module in _attention_layers(model)
    }


def read_layer_details(model) -> dict[int, dict]:
    """`apply_model` target: the scale buffers behind the floats, q scale and cache dtype, per layer."""

    def values(module, attr):
        tensor = getattr(module, attr, None)
        return None if tensor is None else [float(x) for x in tensor.detach().float().cpu().flatten()]

    return {
        index: {
            "module": type(module).__name__,
            "k_scale_buffer": values(module, "_k_scale"),
            "v_scale_buffer": values(module, "_v_scale"),
            "q_scale_buffer": values(module, "_q_scale"),
            "q_scale_float": float(getattr(module, "_q_scale_float", float("nan"))),
            "num_heads": int(module.num_heads),
            "num_kv_heads": int(module.num_kv_heads),
            "kv_cache_dtype": str(module.kv_cache_dtype),
            "impl_kv_cache_dtype": str(getattr(getattr(module, "impl", None), "kv_cache_dtype", None)),
            "kv_cache_tensor_dtype": _cache_tensor_dtype(module),
        }
        for index, module in _attention_layers(model)
    }


def _cache_tensor_dtype(module) -> str | None:
    """dtype of the cache tensor vLLM bound to this layer (None before binding or when absent)."""
    cache = getattr(module, "kv_cache", None)
    if isinstance(cache, (list, tuple)):  # one per virtual engine in some versions
        cache = cache[0] if cache else None
    if cache is None or not hasattr(cache, "dtype") or cache.numel() == 0:
        return None
    return str(cache.dtype).removeprefix("torch.")


def skipped_layers(ckpt: Path) -> list[int]:
    """Layers kvcalib kept in the model dtype (`skipped_layers` of kvcalib.json); [] without the file."""
    provenance = ckpt / "kvcalib.json"
    if not provenance.is_file():
        return []
    return sorted(int(i) for i in json.loads(provenance.read_text()).get("skipped_layers") or [])


def head_size(ckpt: Path) -> int:
    """Attention head size from config.json (head_dim, else hidden_size / num_attention_heads)."""
    config = json.loads((ckpt / "config.json").read_text())
    config = config.get("text_config", config) if "num_attention_heads" not in config else config
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def fp8_kv_unsupported_reason(head: int) -> str | None:
    """vLLM's own reason this host cannot hold an FP8 KV cache, or None when it can.

    Asks the CPU attention backend the question it asks when it allocates the cache (block size 128, the
    CPU default), so the answer is the engine's, not a copy of its CPU-feature rules. GPU hosts: None.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import torch
    try:  # a private helper of vLLM 0.32; without it, ask for FP8 and let the engine answer
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None

    try:
        _get_attn_isa(torch.bfloat16, 128, head, "fp8")
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return None


def _has_tokenizer(ckpt: Path) -> bool:
    return any((ckpt / name).is_file() for name in _TOKENIZER_FILES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens to generate; 0 skips generation")
    parser.add_argument("--kv-cache-dtype", choices=("fp8", "bfloat16", "fp8-or-bfloat16"), default="fp8-or-bfloat16",
                        help="cache dtype; the default falls back to the model dtype where vLLM refuses FP8")
    args = parser.parse_args(argv)

    # Must be set before vLLM is imported; the engine process inherits them.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default pool would take a large share of RAM
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets apply_model ship our functions
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    if here not in sys.path:
        sys.path.insert(0, here)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Import ourselves by module name so the functions pickle by reference, not as `__main__.<fn>`.
    import vllm_probe

    ckpt = args.ckpt.resolve()
    use_tokenizer = _has_tokenizer(ckpt)
    # What `kvcalib calibrate` prints for serving: --kv-cache-dtype-skip-layers <skipped_layers>.
    skip = [str(i) for i in skipped_layers(ckpt)]
    unsupported = None
    if args.kv_cache_dtype == "bfloat16":
        unsupported = "--kv-cache-dtype bfloat16 asked for the model-dtype cache"
    elif args.kv_cache_dtype == "fp8-or-bfloat16":
        unsupported = fp8_kv_unsupported_reason(head_size(ckpt))
    llm = LLM(
        model=str(ckpt),
        # Not "auto": with a kv_cache_scheme in config.json vLLM turns "auto" into fp8; an explicit dtype wins.
        kv_cache_dtype="bfloat16" if unsupported else "fp8",
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        seed=0,
        skip_tokenizer_init=not use_tokenizer,
        kv_cache_dtype_skip_layers=skip,
    )

    scales = llm.apply_model(vllm_probe.read_kv_scales)[0]
    details = llm.apply_model(vllm_probe.read_layer_details)[0]

    try:
        cache_config, model_config = llm.llm_engine.vllm_config.cache_config, llm.llm_engine.vllm_config.model_config
    except AttributeError:
        cache_config, model_config = llm.llm_engine.cache_config, llm.llm_engine.model_config
    kv_cache_dtype = str(cache_config.cache_dtype)
    engine_skip = [str(x) for x in getattr(cache_config, "kv_cache_dtype_skip_layers", None) or []]

    generated: list[int] = []
    if args.max_tokens > 0:
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=use_tokenizer
        )
        prompt = _PROMPT_TEXT if use_tokenizer else TokensPrompt(prompt_token_ids=_PROMPT_IDS)
        outputs = llm.generate([prompt], params, use_tqdm=False)
        generated = [int(t) for t in outputs[0].outputs[0].token_ids]

    result = {
        "scales": {str(i): [k, v] for i, (k, v) in sorted(scales.items())},
        "layers": {str(i): d for i, d in sorted(details.items())},
        "kv_cache_dtype": kv_cache_dtype,
        "fp8_kv_unsupported": unsupported,
        "model_dtype": str(model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype_skip_layers": {"passed": skip, "engine": engine_skip},
        "generated_token_ids": generated,
        "prompt": _PROMPT_TEXT if use_tokenizer else _PROMPT_IDS,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"scales": result["scales"], "kv_cache_dtype": kv_cache_dtype, "generated": generated}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
