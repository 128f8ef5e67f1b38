"""calib.recipe.recipe: defaults, shipped recipes, validation messages, overrides and round-trips."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from calib.recipe import recipe as R
from calib.recipe.recipe import Recipe, RecipeError

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
KNOWN = sorted(f.name for f in fields(Recipe))

# Written out by hand: the documented defaults, not read back from the dataclass.
DEFAULTS = {"dtype": "fp8_e4m3", "granularity": "tensor", "observer": "absmax", "observer_params": {}, "headroom": 1.0,
            "q_scale": False, "skip_layers": [], "samples": 128, "seq_len": 512, "min_tokens": 16, "batch_size": 4,
            "pack": False, "seed": 0, "targets": ["vllm"]}


def recipe_error(data: dict) -> str:
    with pytest.raises(RecipeError) as ei:
        R.from_dict(data)
    return str(ei.value)


def load_error(path: Path) -> str:
    with pytest.raises(RecipeError) as ei:
        R.load(path)
    return str(ei.value)


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# ---------------------------------------------------------------- defaults and shipped recipes

def test_defaults_are_valid_and_documented():
    r = Recipe()
    assert r.to_dict() == DEFAULTS
    assert type(r.headroom) is float and r.targets == ("vllm",)
    assert set(Recipe.field_docs()) == set(DEFAULTS) and all(Recipe.field_docs().values())


def test_load_none_gives_defaults():
    assert R.load(None) == Recipe()


def test_empty_file_gives_defaults(tmp_path):
    assert R.load(write(tmp_path, "# nothing set\n")) == Recipe()


def test_shipped_recipes_exist():
    assert any(p.name == "fp8-tensor.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_loads_with_its_values(path):
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    loaded = R.load(path).to_dict()
    for key, value in raw.items():
        assert loaded[key] == value, key
    assert {k: v for k, v in loaded.items() if k not in raw} == {k: v for k, v in DEFAULTS.items() if k not in raw}


# ---------------------------------------------------------------- validation

def test_unknown_key_names_it_and_lists_known_fields():
    msg = recipe_error({"headrom": 1.5})
    assert "'headrom'" in msg
    assert all(name in msg for name in KNOWN)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "samples: 8\nseqlen: 64\n")
    msg = load_error(path)
    assert str(path) in msg and "'seqlen'" in msg and "seq_len" in msg


def test_non_string_keys_are_unknown_fields(tmp_path):
    assert "1" in recipe_error({1: 2, "samples": 4, "zzz": 0})
    path = write(tmp_path, "1: 2\nfoo: 3\n")
    msg = load_error(path)
    assert str(path) in msg and "'foo'" in msg


@pytest.mark.parametrize("name, value", [
    ("samples", "128"),
    ("samples", True),
    ("seq_len", 512.0),
    ("min_tokens", None),
    ("batch_size", False),
    ("seed", "0"),
    ("dtype", ["fp8_e4m3"]),
    ("granularity", 1),
    ("headroom", "1.0"),
    ("headroom", True),
    ("pack", 1),
    ("pack", "yes"),
    ("targets", 5),
    ("targets", ["vllm", 3]),
    ("targets", {"vllm": True}),
])
def test_wrong_type_names_the_field(name, value):
    msg = recipe_error({name: value})
    shown = repr(tuple(value)) if name == "targets" and isinstance(value, list) else repr(value)  # targets: list -> tuple
    assert f"'{name}'" in msg and "wrong type" in msg and shown in msg


def test_wrong_type_in_file_names_file_and_field(tmp_path):
    path = write(tmp_path, "samples: many\n")
    msg = load_error(path)
    assert str(path) in msg and "'samples'" in msg and "'many'" in msg


@pytest.mark.parametrize("name, value", [("dtype", "int4"), ("granularity", "row"), ("observer", "minmax"),
                                         ("targets", ["vllm", "tensorrt"])])
def test_bad_choice_names_accepted_values(name, value):
    msg = recipe_error({name: value})
    accepted = {"dtype": "fp8_e4m3, int8", "granularity": "tensor, head, channel, token",
                "observer": "absmax, percentile, mse, rope_bound", "targets": "vllm, trtllm"}[name]
    assert f"'{name}'" in msg and "accepted" in msg and accepted in msg


def test_empty_targets_means_statistics_only_and_allows_analysis_granularities():
    assert R.from_dict({"targets": [], "granularity": "channel"}).targets == ()
    assert R.from_dict({"targets": [], "granularity": "token"}).granularity == "token"


@pytest.mark.parametrize("fields, says", [
    ({"granularity": "channel"}, "cannot be exported"),
    ({"granularity": "token", "targets": ["trtllm"]}, "cannot be exported"),
    ({"dtype": "int8"}, "vLLM has no static INT8 KV cache"),
    ({"q_scale": True, "targets": ["trtllm"], "dtype": "int8"}, "needs target vllm"),
    ({"observer": "percentile", "observer_params": {"q": 1}}, "accepted: p"),
    ({"observer": "percentile", "observer_params": {"p": 0}}, "observer_params.p"),
    ({"observer": "mse", "observer_params": {"grid": 1.5}}, "observer_params.grid"),
    ({"observer_params": {"p": 99}}, "does not take"),
    ({"skip_layers": [-1]}, "'skip_layers'"),
    ({"skip_layers": ["sliding"]}, "sliding_window"),
    ({"targets": ["vllm", "vllm"]}, "twice"),
])
def test_impossible_combinations_name_the_field_and_the_fix(fields, says):
    assert says in recipe_error(fields)


def test_skip_layers_and_targets_from_comma_strings():
    r = R.from_dict({"skip_layers": "0,3,sliding_window", "targets": "vllm"})
    assert r.skip_layers == (0, 3, "sliding_window") and r.targets == ("vllm",)
    assert R.from_dict({"targets": "vllm,trtllm"}).targets == ("vllm", "trtllm")
    assert "cannot skip" in recipe_error({"skip_layers": [1], "targets": ["trtllm"]})
    assert R.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("value", [0, 0.0, -1.0, -0.5, math.inf, -math.inf, math.nan,
                                   pytest.param(10**400, id="int-too-big-for-float")])
def test_bad_headroom(value):
    assert "'headroom'" in recipe_error({"headroom": value})


@pytest.mark.parametrize("value, expected", [(1, 1.0), (2, 2.0), (1.25, 1.25), (1e-3, 1e-3)])
def test_good_headroom_is_a_float(value, expected):
    r = R.from_dict({"headroom": value})
    assert r.headroom == expected and type(r.headroom) is float


@pytest.mark.parametrize("name", ["samples", "seq_len", "min_tokens", "batch_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_counts_must_be_positive(name, value):
    assert f"'{name}'" in recipe_error({name: value})


def test_min_tokens_above_seq_len():
    msg = recipe_error({"seq_len": 64, "min_tokens": 65})
    assert "'min_tokens'" in msg and "'seq_len'" in msg and "65" in msg and "64" in msg
    assert R.from_dict({"seq_len": 64, "min_tokens": 64}).min_tokens == 64


def test_targets_from_comma_string():
    assert R.from_dict({"targets": "vllm"}).targets == ("vllm",)
    assert R.from_dict({"targets": "vllm,sglang"}).targets == ("vllm", "sglang")
    assert "'targets'" in recipe_error({"targets": "vllm,tgi"})


# ---------------------------------------------------------------- replace / round-trip

def test_replace_applies_non_none_overrides_only():
    base = R.from_dict({"samples": 64, "seq_len": 256, "seed": 9})
    r = base.replace(samples=8, seq_len=None, headroom=2, pack=True, seed=None)
    assert r.to_dict() == {**DEFAULTS, "samples": 8, "seq_len": 256, "seed": 9, "headroom": 2.0, "pack": True}
    assert base.samples == 64 and base.pack is False  # the original is untouched
    assert base.replace() == base and base.replace(samples=None) == base


def test_replace_validates_overrides():
    with pytest.raises(RecipeError, match="'samples'"):
        Recipe().replace(samples="10")
    with pytest.raises(RecipeError, match="'min_tokens'"):
        Recipe().replace(seq_len=8)  # default min_tokens 16 no longer fits
    with pytest.raises(RecipeError, match="'sampels'"):
        Recipe().replace(sampels=10)


def test_to_dict_round_trips():
    r = R.from_dict({"headroom": 1.5, "samples": 3, "seq_len": 40, "min_tokens": 40, "batch_size": 1,
                     "pack": True, "seed": -7, "targets": ["vllm"]})
    d = r.to_dict()
    assert R.from_dict(d) == r
    assert d["targets"] == ["vllm"] and d["headroom"] == 1.5 and d["seed"] == -7


def test_to_dict_round_trips_through_a_yaml_file(tmp_path):
    r = R.from_dict({"headroom": 1.125, "samples": 17, "pack": True})
    path = write(tmp_path, yaml.safe_dump(r.to_dict()))
    assert R.load(path) == r


# ---------------------------------------------------------------- files

def test_invalid_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "samples: [1, 2\nseq_len: 8\n")
    msg = load_error(path)
    assert str(path) in msg and "YAML" in msg and "\n" not in msg


@pytest.mark.parametrize("text", ["- samples\n- 4\n", "[]\n", "0\n", "false\n", "just words\n"])
def test_non_mapping_yaml_names_the_file(tmp_path, text):
    path = write(tmp_path, text)
    msg = load_error(path)
    assert str(path) in msg and "mapping" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = load_error(path)
    assert str(path) in msg and "not found" in msg


def test_folder_is_not_a_recipe_file(tmp_path):
    assert "not found" in load_error(tmp_path)


def test_non_utf8_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# caf\u00e9\nsamples: 4\n".encode("latin-1"))
    msg = load_error(path)
    assert str(path) in msg and "UTF-8" in msg


# ---------------------------------------------------------------- property: only RecipeError escapes

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**1024, max_value=2**1100),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["fp8_e4m3", "tensor", "absmax", "vllm", "int4", "", "vllm,vllm"]),
    st.lists(st.one_of(st.sampled_from(["vllm", "trtllm", "x", "sliding_window"]), st.integers(), st.none(),
                       st.floats()), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.tuples(st.text(max_size=3)),
)


@settings(max_examples=400, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(KNOWN), VALUES, max_size=len(KNOWN)))
def test_random_dicts_raise_only_recipe_error(data):
    try:
        r = R.from_dict(data)
    except RecipeError as e:
        assert str(e)
        return
    # whatever was accepted satisfies the documented invariants
    assert type(r.headroom) is float and 0 < r.headroom < math.inf
    for name in ("samples", "seq_len", "min_tokens", "batch_size", "seed"):
        assert type(getattr(r, name)) is int
    assert 1 <= r.min_tokens <= r.seq_len and r.samples >= 1 and r.batch_size >= 1
    assert type(r.pack) is bool and set(r.targets) <= {"vllm", "trtllm"}
    assert r.targets or r.granularity in ("channel", "token", "tensor", "head")
    assert all((type(x) is int and x >= 0) or x == "sliding_window" for x in r.skip_layers)
    assert R.from_dict(r.to_dict()) == r
