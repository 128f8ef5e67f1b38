"""Routing a model's attention through a function of ours, which calls the model's own implementation.

Why a module of its own: the capture (calib.capture.hook) and the evaluation's fake quantisation
(calib.evaluation.fakequant) both switch a transformers model to a wrapper registered in
`ALL_ATTENTION_FUNCTIONS` and must always switch it back; how that is done depends on transformers' attention
interface, not on what the wrapper does.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator

import torch

from calib.errors import KvcalibError

_ids = itertools.count()


class AttentionError(KvcalibError, RuntimeError):
    """The model's attention cannot be routed through a wrapper (unknown implementation, no eager function)."""


def _delegate_for(impl: str) -> Callable:
    """The model's own attention function for `impl` ('eager' lives in each model's modeling file)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl != "eager":
        return ALL_ATTENTION_FUNCTIONS[impl]
    cache: dict[type, Callable] = {}

    def eager(module, *args, **kwargs):
        fn = cache.get(type(module))
        if fn is None:
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise AttentionError(f"{type(module).__name__} has no eager_attention_forward to delegate to")
            cache[type(module)] = fn
        return fn(module, *args, **kwargs)

    return eager


@contextlib.contextmanager
def route_attention(model: torch.nn.Module, make: Callable[[Callable], Callable], tag: str) -> Iterator[None]:
    """Switch `model` to the attention function `make(delegate)`, where `delegate` is the model's own
    implementation, registered under a fresh name (with the delegate's mask function); always restores
    the model's implementation and unregisters the name, also on exceptions."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = model.config._attn_implementation
    if original not in ("eager", "sdpa") and original not in ALL_ATTENTION_FUNCTIONS:
        raise AttentionError(f"attention implementation {original!r} is not known to transformers' AttentionInterface")
    name = f"kvcalib_{tag}_{next(_ids)}"
    ALL_ATTENTION_FUNCTIONS.register(name, make(_delegate_for(original)))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise AttentionError(f"{type(model).__name__} refused a custom attention implementation; "
                                 "it does not use transformers' AttentionInterface")
        yield
    finally:
        try:
            model.set_attn_implementation(original)
        finally:
            ALL_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
