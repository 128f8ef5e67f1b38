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
    if kv_dtype is not None and e.kv_flag and kv_dtype not in KV_FLAG[e.name]:
        raise support.SupportError(f"{e.title} has no {e.kv_flag} for {kv_dtype}; "
                                   f"{support.who_serves(kv_dtype) if kv_dtype in support.KV_FORMATS else ''}")
    layers = support.skip_order(skip)
    if layers and e.skip_flag is None:
        raise support.SupportError(f"{e.title} cannot keep layers {layers} in the model dtype: no per-layer KV "
                                   "dtype option")
    served = dtypes.KV_FORMATS[kv_dtype].served(e.name) if kv_dtype in dtypes.KV_FORMATS else None
    return spelled(e.name, KV_FLAG[e.name].get(kv_dtype), layers, served.backend if served else None)


def spelled(engine: str, cache_name: str | None, skip: Iterable[int | str] = (),
            backend: str | None = None) -> list[str]:
    """The options for values already in the engine's own words: its cache name (None: the model's dtype), the
    layers it keeps in the model dtype (in the order given) and an attention backend."""
    e = support.engine(engine)
    out = [e.kv_flag, cache_name] if cache_name and e.kv_flag else []
    skip = [str(s) for s in skip]
    if skip:
        out += [e.skip_flag, *skip]
    return out + ([e.backend_flag, backend] if backend and e.backend_flag else [])


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
