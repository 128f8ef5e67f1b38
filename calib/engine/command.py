"""The one serve command: how each engine is told to serve a KV format, its skipped layers and a context length.

Why one module: calibrate and export (through each target's `serve_command`), eval's verdict, plan and tune each
printed their own `vllm serve` line, and they drifted: plan dropped the layers a checkpoint keeps in the model
dtype (vLLM then quantizes them at scale 1.0), and eval's verdict printed vLLM's `--kv-cache-dtype fp8` for an
SGLang target or an INT8 arm. Each engine's spelling lives here once; a KV dtype an engine has no flag for is an
error, never another engine's flag. Torch-free.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from calib.engine import support

SKIP_FLAG = "--kv-cache-dtype-skip-layers"
# the engine's --kv-cache-dtype value for each KV format it has a flag for (calib.engine.support.KV_FORMATS)
KV_FLAG = {"vllm": {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2", **{f: f for f in support.DYNAMIC_FORMATS}},
           "sglang": {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"},
           "trtllm": {},                   # TensorRT-LLM reads the KV algorithm from hf_quant_config.json
           "trtllm-engine": {}}            # ... and its TensorRT-engine backend from the checkpoint's config.json
TRITON = ["--attention-backend", "TRITON_ATTN"]   # vLLM: only its Triton backend implements per-token-head caches


def has_flag(engine: str, kv_dtype: str) -> bool:
    """Whether `engine` is told `kv_dtype` on its command line (TensorRT-LLM never: its checkpoint says it)."""
    return kv_dtype in KV_FLAG[support.engine(engine).name]


def flags(engine: str, kv_dtype: str | None = None, skip: Iterable[int | str] = ()) -> list[str]:
    """The options after the model that serve `kv_dtype` (None: the model's own dtype) with `skip` kept in the
    model dtype. SupportError for a KV dtype the engine has no flag for, or skips it cannot express."""
    e = support.engine(engine)
    out: list[str] = []
    if kv_dtype is not None and not e.name.startswith("trtllm"):
        if kv_dtype not in KV_FLAG[e.name]:
            raise support.SupportError(f"{e.title} has no --kv-cache-dtype for {kv_dtype}; "
                                       f"{support.who_serves(kv_dtype) if kv_dtype in support.KV_FORMATS else ''}")
        out += ["--kv-cache-dtype", KV_FLAG[e.name][kv_dtype]]
    layers = support.skip_order(skip)
    if layers:
        if e.name != "vllm":
            raise support.SupportError(f"{e.title} cannot keep layers {layers} in the model dtype: no per-layer KV "
                                       "dtype option")
        out += [SKIP_FLAG, *map(str, layers)]
    if e.name == "vllm" and kv_dtype in support.DYNAMIC_FORMATS:
        out += TRITON
    return out


def argv(engine: str, model: str, kv_dtype: str | None = None, skip: Iterable[int | str] = (),
         max_model_len: int | None = None) -> list[str]:
    """The whole command serving `model` (a checkpoint folder or the model) on `engine`, as arguments."""
    name = support.engine(engine).name
    head = {"vllm": ["vllm", "serve", model], "sglang": ["python", "-m", "sglang.launch_server", "--model-path", model],
            "trtllm": ["trtllm-serve", model],
            "trtllm-engine": ["trtllm-serve", model, "--backend", "tensorrt"]}[name]
    if max_model_len is not None:
        head += [{"vllm": "--max-model-len", "sglang": "--context-length", "trtllm": "--max_seq_len",
                 "trtllm-engine": "--max_seq_len"}[name],
                 str(max_model_len)]
    return head + flags(name, kv_dtype, skip)


def line(engine: str, model: str, kv_dtype: str | None = None, skip: Iterable[int | str] = (),
         max_model_len: int | None = None) -> str:
    """`argv` as one shell line (the model path quoted where it needs it)."""
    return shlex.join(argv(engine, model, kv_dtype, skip, max_model_len))
