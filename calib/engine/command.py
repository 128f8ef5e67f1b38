"""The one serve command: how each engine is told to serve a KV format, its skipped layers and a context length.

Why one module: calibrate and export (through each target's `serve_command`), eval's verdict, plan and tune each
printed their own `vllm serve` line, and they drifted: plan dropped the layers a checkpoint keeps in the model
dtype (vLLM then quantizes them at scale 1.0), and eval's verdict printed vLLM's `--kv-cache-dtype fp8` for an
SGLang target or an INT8 arm. Every command line is built here, from each engine's spelling written once (its
command head and options in its support-matrix module, calib.recipe.support.engines; its names for the KV
formats in calib.recipe.dtypes); a KV dtype an engine has no flag for is an error, never another engine's flag.
Torch-free.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from calib.recipe import dtypes, support

SKIP_FLAG = support.ENGINES["vllm"].skip_flag
# the engine's --kv-cache-dtype value for each KV format it has a flag for: the engine's name for the format
# (calib.recipe.dtypes); none for an engine whose checkpoint names the KV format (TensorRT-LLM)
KV_FLAG = {name: ({d.name: d.cache_name(name) for d in dtypes.for_engine(name, dtypes.KV_FORMATS)} if e.kv_flag
                  else {}) for name, e in support.ENGINES.items()}


def flags(engine: str, kv_dtype: str | None = None, skip: Iterable[int | str] = ()) -> list[str]:
    """The options after the model that serve `kv_dtype` (None: the model's own dtype) with `skip` kept in the
    model dtype, and the attention backend the format needs there. SupportError for a KV dtype the engine has no
    flag for, or skips it cannot express."""
    e = support.engine(engine)
    out: list[str] = []
    if kv_dtype is not None and e.kv_flag:
        if kv_dtype not in KV_FLAG[e.name]:
            raise support.SupportError(f"{e.title} has no {e.kv_flag} for {kv_dtype}; "
                                       f"{support.who_serves(kv_dtype) if kv_dtype in support.KV_FORMATS else ''}")
        out += [e.kv_flag, KV_FLAG[e.name][kv_dtype]]
    layers = support.skip_order(skip)
    if layers:
        if e.skip_flag is None:
            raise support.SupportError(f"{e.title} cannot keep layers {layers} in the model dtype: no per-layer KV "
                                       "dtype option")
        out += [e.skip_flag, *map(str, layers)]
    served = dtypes.KV_FORMATS[kv_dtype].served(e.name) if kv_dtype in dtypes.KV_FORMATS else None
    if served is not None and served.backend and e.backend_flag:
        out += [e.backend_flag, served.backend]
    return out


def argv(engine: str, model: str, kv_dtype: str | None = None, skip: Iterable[int | str] = (),
         max_model_len: int | None = None) -> list[str]:
    """The whole command serving `model` (a checkpoint folder or the model) on `engine`, as arguments."""
    e = support.engine(engine)
    head = [model if part == "{model}" else part for part in e.serve]
    if max_model_len is not None:
        head += [e.context_flag, str(max_model_len)]
    return head + flags(e.name, kv_dtype, skip)


def line(engine: str, model: str, kv_dtype: str | None = None, skip: Iterable[int | str] = (),
         max_model_len: int | None = None) -> str:
    """`argv` as one shell line (the model path quoted where it needs it)."""
    return shlex.join(argv(engine, model, kv_dtype, skip, max_model_len))
