"""calib.recipe.safeyaml and the recipe loader on hostile YAML: bombs, duplicates, depth, size, arbitrary bytes."""

from __future__ import annotations

import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calib.recipe import recipe as R
from calib.recipe.dtypes import MSE_GRID_MAX
from calib.recipe import safeyaml
from calib.recipe.safeyaml import SafeYAMLError

# The classic "billion laughs": 9 levels of 9 aliases, ~10^9 strings once expanded (441 bytes).
BOMB = "# billion laughs 441 bytes\n" + "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi")]) + "\n"

scalars = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
plain = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=20)


def error(text: str) -> str:
    with pytest.raises(SafeYAMLError) as ei:
        safeyaml.loads(text, "f.yaml")
    msg = str(ei.value)
    assert msg.startswith("f.yaml") and "\n" not in msg
    return msg


def test_bomb_fails_fast_at_the_first_anchor():
    assert len(BOMB) == 441
    t0 = time.perf_counter()
    msg = error(BOMB)
    assert time.perf_counter() - t0 < 0.05
    assert "line 2" in msg and "anchor &a" in msg


@pytest.mark.parametrize("text, words", [
    ("x: *undefined\n", "alias *undefined"),
    ("base: {a: 1}\nr:\n  <<: {b: 2}\n", "merge key"),
    ("samples: 8\nheadroom: 2\nheadroom: 1\n", "line 3: duplicate key 'headroom' (first on line 2)"),
    ("observer_params: {grid: 10, grid: 20}\n", "duplicate key 'grid'"),
    ("a: 1\n---\nb: 2\n", "another document"),
    ("a: [1, 2\n", "not valid YAML"),
])
def test_refused_constructs_name_the_line(text, words):
    assert words in error(text)


def test_depth_limit():
    ok = "[" * safeyaml.MAX_DEPTH + "]" * safeyaml.MAX_DEPTH
    assert safeyaml.loads(ok, "f.yaml") is not None
    assert "nested deeper than 16" in error("[" * 17 + "]" * 17)
    assert "nested deeper" in error("[" * 5000 + "]" * 5000)      # no RecursionError, no traceback


def test_size_cap(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * safeyaml.MAX_BYTES + "\n")
    with pytest.raises(SafeYAMLError, match="larger than 64 KiB"):
        safeyaml.load(big)
    assert "larger than 64 KiB" in error("a: " + "x" * safeyaml.MAX_BYTES)


def test_unreadable_and_not_utf8(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(SafeYAMLError, match="not UTF-8"):
        safeyaml.load(p)
    with pytest.raises(SafeYAMLError, match="cannot be read"):
        safeyaml.load(tmp_path)                                        # a directory


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain)
def test_plain_documents_read_as_safe_load_does(value):
    text = yaml.safe_dump(value, default_flow_style=None, allow_unicode=True)
    assert safeyaml.loads(text, "f.yaml") == yaml.safe_load(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_value_or_one_line_error(text):
    try:
        safeyaml.loads(text, "f.yaml")
    except SafeYAMLError as e:
        assert str(e).startswith("f.yaml") and "\n" not in str(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_recipe_file_of_any_bytes_is_a_recipe_or_a_recipe_error(tmp_path, raw):
    path = tmp_path / "r.yaml"
    path.write_bytes(raw)
    try:
        R.load(path)
    except R.RecipeError as e:
        assert str(path) in str(e) and "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["samples", "seq_len", "batch_size", "min_tokens", "headroom", "seed",
                                        "observer", "observer_params", "skip_layers", "targets"]),
                       st.one_of(st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6),
                                 st.dictionaries(st.sampled_from(["p", "grid", "min_ratio", "bins"]),
                                                 st.one_of(st.integers(-2**40, 2**40), st.floats())),
                                 st.lists(st.integers(-5, 2**30), max_size=3)), max_size=4))
def test_recipe_values_are_bounded_or_refused(data):
    try:
        r = R.from_dict(data)
    except R.RecipeError as e:
        assert "recipe field" in str(e) or "unknown field" in str(e)
        return
    assert 1 <= r.samples <= R.LIMITS["samples"] and 1 <= r.batch_size <= R.LIMITS["batch_size"]
    assert 1 <= r.seq_len <= R.LIMITS["seq_len"] and 0 < r.headroom <= R.LIMITS["headroom"]
    assert r.observer_params.get("grid", 2) <= MSE_GRID_MAX and "bins" not in r.observer_params


@pytest.mark.parametrize("data, words", [
    ({"observer": "mse", "observer_params": {"grid": 10**9}}, "'observer_params.grid' = 1000000000: must be an integer in [2, 4096]"),
    ({"observer": "percentile", "observer_params": {"p": 1e9}}, "'observer_params.p'"),
    ({"samples": 10**12}, "'samples' = 1000000000000 is beyond 10,000,000"),
    ({"seq_len": 10**9}, "'seq_len'"),
    ({"headroom": 1e300}, "'headroom'"),
    ({"seed": 2**80}, "'seed'"),
    ({"skip_layers": [2**40]}, "'skip_layers'"),
])
def test_recipe_bounds_name_field_and_fix(data, words):
    with pytest.raises(R.RecipeError, match=None) as ei:
        R.from_dict(data)
    assert words in str(ei.value)
