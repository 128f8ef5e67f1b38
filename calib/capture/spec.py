"""Which observers a recipe asks for: the one place a Recipe becomes an `capture.hook.CaptureSpec`.

Why a module of its own: the calibration loop (calib.pipeline) and the statistics-file reader (which rebuilds
a run's observers to load their state) both need it; living in either made the two import each other.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from calib.capture import hook as observe
from calib.capture.observers import RotaryLayout, make_observer
from calib.model import load as model_mod
from calib.recipe.granularity import PerChannel, PerToken
from calib.recipe.recipe import Recipe

TOKEN_QUANTILES = (50.0, 90.0, 99.0, 100.0)


def capture_spec(recipe: Recipe, config: Any = None, *, rotary_dim: int | None = None) -> observe.CaptureSpec:
    """Observers the recipe asks for. `rope_bound` applies to K only (V is not rotated): V then uses absmax.
    The rotary layout comes from the model `config` (or `rotary_dim` when rebuilding from a statistics file)."""
    dtype, obs, gran = recipe.kv_dtype, recipe.observer_spec, recipe.scale_granularity
    params = dict(recipe.observer_params)
    k_obs = v_obs = None
    if not obs.exact:       # the exact max is recorded by every capture
        # only rope_bound needs the rotary layout: a statistics file of another observer may lack rotary_dim
        rotary = RotaryLayout(rotary_dim if rotary_dim is not None else model_mod.rotary_dim(config)) if obs.k_only \
            else None
        k_obs = partial(make_observer, obs.name, params, dtype, rotary)
        if not obs.k_only:
            v_obs = partial(make_observer, obs.name, params, dtype, None)
    token = isinstance(gran, PerToken)
    return observe.CaptureSpec(
        k_observer=k_obs, v_observer=v_obs, q=recipe.q_scale, channels=isinstance(gran, PerChannel),
        token_quantiles=TOKEN_QUANTILES if token else (),
        token_observer=(lambda p: make_observer("percentile", {"p": p}, dtype, None)) if token else None)
