"""calib.capture.statsfile's one reader on hostile statistics and resume files.

Property: whatever is done to a statistics file (a flipped byte, a cut, an edited header field, a tensor
scaled, reshaped, dropped or added), `statsfile.load` either raises one StatsError line naming the file, or
returns exactly the statistics that were saved. The reference is the capture the file was written from.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from calib.capture import hook as observe, statsfile
from calib.capture.spec import capture_spec
from calib.scales.stats import Stats, stats_to_tensors
from calib.recipe.recipe import from_dict

RECIPES = {"absmax": {}, "percentile": {"observer": "percentile", "observer_params": {"p": 99.0}},
           "mse": {"observer": "mse", "observer_params": {"grid": 20}},
           "token": {"granularity": "token", "targets": []}, "channel": {"granularity": "channel", "targets": []}}
LAYERS = [0, 1]


def _capture(recipe_fields: dict) -> tuple[observe.KVCapture, dict]:
    recipe = from_dict(recipe_fields)
    cap = observe.KVCapture(LAYERS, capture_spec(recipe, rotary_dim=8))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for i in LAYERS:
            q, k, v = (torch.randn(2, h, 5, 8, generator=g) * 3 for h in (4, 2, 2))
            with cap.masking(torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)):
                cap.record(i, q, k, v)
    header = {"producer": "kvcalib", "model": "m", "model_config_sha256": "sha256:x", "rotary_dim": 8,
              "recipe": recipe.to_dict(), "data": {"samples": 4, "tokens": 18}}
    return cap, header


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[bytes, Stats]]:
    base = tmp_path_factory.mktemp("stats")
    out = {}
    for name, fields in RECIPES.items():
        cap, header = _capture(fields)
        path = statsfile.save(base / f"{name}.safetensors", cap, header)
        out[name] = (path.read_bytes(), cap.stats())
    return out


def _same(a: Stats, b: Stats) -> bool:
    return observe_tensors(a).keys() == observe_tensors(b).keys() and all(
        torch.equal(x, observe_tensors(b)[k]) for k, x in observe_tensors(a).items())


def observe_tensors(s: Stats) -> dict[str, torch.Tensor]:
    return stats_to_tensors(s)


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_round_trip_is_exact(saved, tmp_path):
    for name, (raw, stats) in saved.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(raw)
        assert _same(statsfile.load(path).stats(), stats), name


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["layers", "recipe", "observer", "p", "grid",
                                                             "rotary_dim", "samples"]), inner, max_size=3),
                           max_leaves=8)
HEADER_KEYS = ["layers", "rotary_dim", "recipe", "data", "model_config_sha256", "batches_done", "recipe.observer",
               "recipe.observer_params", "recipe.granularity", "recipe.q_scale", "recipe.dtype", "recipe.samples"]


def _mutate(raw: bytes, data: st.DataObject, keep_checksum: bool) -> bytes:
    header, body = _split(raw)
    meta = header["__metadata__"]
    how = data.draw(st.sampled_from(["byte", "cut", "header", "tensor-scale", "tensor-shape", "tensor-drop",
                                     "tensor-add"]))
    if how == "byte":
        i = data.draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1:]
    if how == "cut":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if not keep_checksum:
        meta.pop(statsfile.CHECKSUM, None)
    if how == "header":
        doc = json.loads(meta["kvcalib"])
        key = data.draw(st.sampled_from(HEADER_KEYS))
        target = doc
        *parents, leaf = key.split(".")
        for p in parents:
            target = target.setdefault(p, {}) if isinstance(target.get(p), dict) else doc
        target[leaf] = data.draw(json_values)
        meta["kvcalib"] = json.dumps(doc)
        return _join(header, body)
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names))
    begin, end = header[name]["data_offsets"]
    t = torch.frombuffer(bytearray(body[begin:end]), dtype={"F32": torch.float32, "F64": torch.float64,
                                                            "I64": torch.int64}[header[name]["dtype"]])
    with safe_open_bytes(raw) as tensors:
        if how == "tensor-scale" and t.numel():
            tensors[name] = tensors[name] * data.draw(st.sampled_from([2, 0.5, -1, 0]))
        elif how == "tensor-shape":
            tensors[name] = torch.cat([tensors[name].reshape(-1), tensors[name].reshape(-1)[:1]])
        elif how == "tensor-drop":
            tensors.pop(name)
        else:
            tensors[name.replace("layers.1", "layers.7")] = tensors[name]
        return save_bytes(tensors, meta)


class safe_open_bytes:
    """All tensors of a safetensors byte string, as a dict (through a temp file)."""

    def __init__(self, raw: bytes) -> None:
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "x.safetensors"
        self.path.write_bytes(raw)

    def __enter__(self) -> dict[str, torch.Tensor]:
        with safe_open(str(self.path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def __exit__(self, *exc) -> None:
        self.dir.cleanup()


def save_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.safetensors"
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(p), metadata=meta)
        return p.read_bytes()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.sampled_from(sorted(RECIPES)), st.booleans(), st.data())
def test_a_damaged_file_is_refused_or_reads_as_saved(saved, tmp_path, name, keep_checksum, data):
    raw, stats = saved[name]
    path = tmp_path / "s.safetensors"
    new = _mutate(raw, data, keep_checksum)
    path.write_bytes(new)
    try:
        sf = statsfile.load(path)
    except statsfile.StatsError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return
    if statsfile.CHECKSUM in _split(new)[0].get("__metadata__", {}):
        assert _same(sf.stats(), stats)   # the checksum held: nothing that matters changed
    else:                                  # an older file without one: what loads is at least well formed
        for s in sf.stats().values():
            assert bool(torch.isfinite(s.k_amax).all()) and bool((s.k_amax >= 0).all())


@pytest.mark.parametrize("edit, words", [
    (lambda h, m: m.update(kvcalib="{"), "kvcalib header is not valid JSON"),
    (lambda h, m: m.pop("kvcalib"), "no kvcalib header"),
    (lambda h, m: m.update(kvcalib=json.dumps({**json.loads(m["kvcalib"]), "layers": "all"})), "field 'layers'"),
    (lambda h, m: m.update(kvcalib=json.dumps({**json.loads(m["kvcalib"]), "recipe": {"observer": "mse",
                                                                                      "observer_params": {"grid": 10**9}}})),
     "'observer_params.grid' = 1000000000"),
    (lambda h, m: m.update({statsfile.CHECKSUM: "sha256:0"}), "does not match its checksum"),
])
def test_header_problems_are_named(saved, tmp_path, edit, words):
    header, body = _split(saved["mse"][0])
    edit(header, header["__metadata__"])
    path = tmp_path / "s.safetensors"
    path.write_bytes(_join(header, body))
    with pytest.raises(statsfile.StatsError) as ei:
        statsfile.load(path)
    assert words in str(ei.value) and str(path) in str(ei.value)


def test_cli_readers_give_one_line(saved, tmp_path, tiny_llama_dir):
    """merge, export --stats and eval --stats on a damaged file: exit 1, one Error: line naming it."""
    from calib.cli import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(saved["absmax"][0][:-7])
    good = tmp_path / "good.safetensors"
    good.write_bytes(saved["absmax"][0])
    for args in (["merge", good, bad, "--out", tmp_path / "m.safetensors"],
                 ["export", "--stats", bad, "--model", tiny_llama_dir, "--out", tmp_path / "o"]):
        r = CliRunner().invoke(main, [str(a) for a in args])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert r.exit_code == 1 and len(errors) == 1 and str(bad) in errors[0], r.output
        assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "o").exists()
