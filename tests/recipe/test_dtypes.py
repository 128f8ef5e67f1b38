"""calib.recipe.dtypes: one typed vocabulary. The recipe, the CLI's choices, the observer factory and the stages read
the same registries, so a name accepted in one place is accepted everywhere, with the same bounds."""

from __future__ import annotations

import inspect

import pytest

from calib.capture import observers
from calib.cli import main
from calib.export.trtllm import ALGO_OF_DTYPE
from calib.export.vllm import VllmTarget
from calib.recipe import granularity
from calib.recipe import recipe as R, dtypes


def _choices(command: str, option: str) -> list[str]:
    """The choices of `command`'s `option` (its flag, e.g. --granularity)."""
    cmd = main.commands[command]
    choices = next(p for p in cmd.params if option in p.opts).type.choices
    return list(choices() if callable(choices) else choices)


def test_cli_choices_are_the_registries():
    kv = _choices("calibrate", "--kv-cache-dtype")
    assert kv == _choices("eval", "--kv-cache-dtype")
    # kvcalib's names and vLLM's (fp8), each naming a registry entry (calib.recipe.dtypes)
    assert [c for c in kv if c in dtypes.KV_DTYPES] == list(dtypes.KV_DTYPES)
    assert {dtypes.kv_format(c, "vllm").name for c in kv if c not in dtypes.KV_DTYPES} <= set(dtypes.KV_DTYPES)
    assert _choices("calibrate", "--granularity") == list(granularity.GRANULARITIES)
    assert _choices("export", "--granularity") == [n for n, g in granularity.GRANULARITIES.items() if g.exportable]
    assert _choices("calibrate", "--observer") == list(dtypes.OBSERVERS)


def test_recipe_hands_out_registry_values():
    r = R.Recipe(dtype="int8", granularity="head", observer="mse", targets=("trtllm",))
    assert r.kv_dtype is dtypes.INT8 and r.kv_dtype.qmax == 127.0
    assert r.scale_granularity is granularity.GRANULARITIES["head"]
    assert r.observer_spec is dtypes.OBSERVERS["mse"]
    stats = R.Recipe(granularity="token", targets=())
    assert not stats.scale_granularity.exportable


# Per observer parameter: values the shared bounds accept and refuse (edges included).
EDGES = {("percentile", "p"): ([1e-9, 50, 100], [0, -1, 100.5]),
         ("mse", "grid"): ([2, dtypes.MSE_GRID_MAX], [1, dtypes.MSE_GRID_MAX + 1]),
         ("mse", "min_ratio"): ([1e-6, 1], [0, 1.5])}


@pytest.mark.parametrize("name, key", sorted(EDGES))
def test_recipe_and_observer_factory_accept_and_refuse_the_same_values(name, key):
    good, bad = EDGES[(name, key)]
    for value in good:
        R.from_dict({"observer": name, "observer_params": {key: value}})
        assert observers.make_observer(name, {key: value}, dtypes.FP8_E4M3, None) is not None
    for value in bad:
        with pytest.raises(R.RecipeError, match=f"'observer_params.{key}' = "):
            R.from_dict({"observer": name, "observer_params": {key: value}})
        with pytest.raises(ValueError, match=f"{name} {key} = "):
            observers.make_observer(name, {key: value}, dtypes.FP8_E4M3, None)


def test_every_spec_parameter_is_an_observer_constructor_parameter():
    classes = {"percentile": observers.PercentileObserver, "mse": observers.MSEObserver}
    for name, spec in dtypes.OBSERVERS.items():
        if name in classes:
            assert set(spec.params) <= set(inspect.signature(classes[name]).parameters), name
        else:
            assert spec.params == {}, name
    # bins: the observers take it (tests build small histograms), a recipe does not (files must merge)
    assert observers.make_observer("percentile", {"bins": 256}, dtypes.FP8_E4M3, None).bins == 256
    with pytest.raises(R.RecipeError, match="'bins', which a recipe does not set .*2048 bins"):
        R.from_dict({"observer": "percentile", "observer_params": {"bins": 256}})
    assert observers.PercentileObserver().bins == dtypes.HISTOGRAM_BINS == observers.MSEObserver(dtypes.INT8).bins


def test_engine_targets_map_registry_values():
    assert set(ALGO_OF_DTYPE) == set(dtypes.KV_DTYPES.values())
    assert set(VllmTarget.strategies) == {n for n, g in granularity.GRANULARITIES.items() if g.exportable}


def test_each_format_carries_its_engine_facts_once():
    """Every per-format fact on the KVDtype (calib.recipe.dtypes): the engines' names (vLLM's `fp8` and `fp8_e4m3`
    name one cache), the first version that has it, the backend it needs, bytes per element, tune's short name;
    the other tables are read from it."""
    from calib.engine import command
    from calib.model import layer_kinds
    from calib.recipe import support

    assert dtypes.kv_format("fp8") is dtypes.kv_format("fp8_e4m3", "vllm") is dtypes.FP8_E4M3
    assert dtypes.kv_format("INT8", "trtllm") is dtypes.INT8 and dtypes.kv_format("fp8_e5m2", "sglang").qmax == 57344
    with pytest.raises(ValueError, match="unknown KV format 'nvfp4'.*an engine's name for one"):
        dtypes.kv_format("nvfp4")
    assert {e for d in dtypes.KV_FORMATS.values() for e in d.engines} == set(support.ENGINES)
    assert dtypes.for_engine("vllm") == (dtypes.FP8_E4M3,) and dtypes.for_engine("trtllm") == (dtypes.FP8_E4M3,
                                                                                            dtypes.INT8)
    assert dtypes.INT8.cache_name("vllm") is None and dtypes.INT8.engine is None      # vLLM has no INT8 KV cache
    assert [(d.served("vllm").since, d.served("vllm").backend) for d in dtypes.KV_FORMATS.values() if d.dynamic] == \
        [("0.20", "TRITON_ATTN"), ("0.20", "TRITON_ATTN"), ("0.25", "TRITON_ATTN")]
    assert dtypes.FP8_E5M2.served("vllm").cuda_backend == "FLASHINFER"
    assert dtypes.MODEL_DTYPE_BYTES["bfloat16"] == 2 and dtypes.KV_FORMATS["int4_per_token_head"].element_bytes == 0.5
    assert {n: b for n, b in layer_kinds.DTYPE_BYTES.items() if n in dtypes.KV_FORMATS} == \
        {n: d.bits // 8 for n, d in dtypes.KV_FORMATS.items() if d.bits == 8}
    assert command.KV_FLAG["vllm"]["fp8_e4m3"] == "fp8" and command.KV_FLAG["trtllm"] == {}
    assert [d.short for d in dtypes.KV_DTYPES.values()] == ["fp8", "int8"]
    assert hash(dtypes.FP8_E4M3) == hash(dtypes.KVDtype("fp8_e4m3", 448.0, short="fp8", cast="float8_e4m3fn"))
