"""calib.ckpt.integrity and calib.model.geometry: contained names, checked shard headers, impossible configs.

References: the safetensors library itself (a header we accept must open there with the same tensors),
transformers' own index `total_size`, and a real Llama built from every geometry we accept.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from calib.ckpt import integrity
from calib.ckpt.integrity import IntegrityError
from calib.model import geometry
from tiny import tiny_causal_lm

FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8, "I64": torch.int64,
          "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}
tensors = st.dictionaries(
    st.text("abcdefgh._0123456789", min_size=1, max_size=12),
    st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6)


def _save(path: Path, spec: dict) -> None:
    save_file({k: torch.zeros(shape, dtype=DTYPES[d]) for k, (d, shape) in spec.items()}, str(path),
              metadata={"format": "pt"})


def _library_reads(path: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception:
        return None


# ---------------------------------------------------------------- shard headers

@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(tensors)
def test_valid_files_read_as_the_library_reads_them(tmp_path, spec):
    path = tmp_path / "a.safetensors"
    _save(path, spec)
    shard = integrity.read_header(path)
    lib = _library_reads(path)
    assert {k: (t.dtype, t.shape) for k, t in shard.tensors.items()} == lib
    assert shard.nbytes == sum(torch.zeros(s, dtype=DTYPES[d]).nbytes for d, s in spec.values())
    assert shard.nbytes == path.stat().st_size - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(tensors, st.data())
def test_damaged_files_are_refused_whenever_the_library_refuses(tmp_path, spec, data):
    """Mutate a valid file (a byte, a cut, an append, a header edit); what we accept, the library opens."""
    path = tmp_path / "a.safetensors"
    _save(path, spec)
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    how = data.draw(st.sampled_from(["byte", "cut", "append", "offsets", "shape", "dtype", "length"]))
    if how == "byte":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    elif how == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "append":
        raw += data.draw(st.binary(min_size=1, max_size=16))
    elif how == "length":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    else:
        header = json.loads(raw[8:8 + n])
        name = data.draw(st.sampled_from(sorted(spec)))
        if how == "offsets":
            header[name]["data_offsets"] = data.draw(st.lists(st.integers(-3, 600), min_size=0, max_size=3))
        elif how == "shape":
            header[name]["shape"] = data.draw(st.lists(st.integers(-1, 6) | st.just(1.5), max_size=3))
        else:
            header[name]["dtype"] = data.draw(st.sampled_from(["F32", "I8", "F128", "", "BF16", 3]))
        new = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(new)) + new) + raw[8 + n:]
    path.write_bytes(bytes(raw))
    try:
        shard = integrity.read_header(path)
    except IntegrityError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    lib = _library_reads(path)
    assert lib is not None, f"accepted a file the library refuses ({how})"
    assert {k: (t.dtype, t.shape) for k, t in shard.tensors.items()} == lib


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.binary(max_size=300))
def test_any_bytes_are_a_header_or_one_line_error(tmp_path, raw):
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    try:
        integrity.read_header(path)
    except IntegrityError as e:
        assert "\n" not in str(e)


# ---------------------------------------------------------------- names inside the folder

parts = st.lists(st.sampled_from(["..", ".", "a", "b", "model.safetensors", "~", "", "/", "c\\d"]), max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE_OK)
@given(parts.map("/".join) | st.text(max_size=20) | st.integers() | st.none())
def test_contained_names_stay_inside(tmp_path, name):
    root = tmp_path / "m"
    (root / "a").mkdir(parents=True, exist_ok=True)
    (root / "link").unlink(missing_ok=True)
    (root / "link").symlink_to(tmp_path)
    try:
        path = integrity.contained(root, name, "index")
    except IntegrityError as e:
        assert str(e).startswith("index") and "\n" not in str(e)
        return
    real = path.resolve()
    assert real == root.resolve() or root.resolve() in real.parents


def test_links_inside_the_folder_and_hub_cache_snapshots_are_fine(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "real.safetensors").write_bytes(b"")
    (root / "alias.safetensors").symlink_to(root / "real.safetensors")
    assert integrity.contained(root, "alias.safetensors", "x") == root / "alias.safetensors"
    with pytest.raises(IntegrityError, match="outside the model folder"):
        (root / "out.safetensors").symlink_to(tmp_path / "elsewhere")
        integrity.contained(root, "out.safetensors", "x")
    snap = tmp_path / "models--org--name" / "snapshots" / "abc123"   # the hub cache links files into ../../blobs
    (snap.parent.parent / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (snap.parent.parent / "blobs" / "f00d").write_bytes(b"{}")
    (snap / "config.json").symlink_to(Path("../../blobs/f00d"))
    assert integrity.contained(snap, "config.json", "x") == snap / "config.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "sharded"
    tiny_causal_lm("llama").save_pretrained(path, max_shard_size="100KB")
    return path


def test_total_size_from_headers_equals_transformers_index(sharded):
    ckpt = integrity.scan(sharded)
    index = json.loads((sharded / integrity.INDEX_FILE).read_text())
    assert ckpt.indexed and len(ckpt.shards) > 1 and ckpt.weight_map == index["weight_map"]
    assert ckpt.total_size == index["metadata"]["total_size"]


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.one_of(st.text(max_size=30), st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2),
                 parts.map("/".join)))
def test_hostile_weight_map_entries_are_one_line_errors(sharded, value):
    index_path = sharded / integrity.INDEX_FILE
    original = index_path.read_text()
    data = json.loads(original)
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = value
    index_path.write_text(json.dumps(data))
    try:
        ckpt = integrity.scan(sharded)
        assert value in ckpt.shards  # only an existing shard that really holds the tensor passes
    except IntegrityError as e:
        assert "\n" not in str(e)
    finally:
        index_path.write_text(original)


@pytest.mark.parametrize("index, words", [
    ("[]", "must hold a JSON object"),
    ('{"weight_map": {}}', "no weight_map object"),
    ('{"weight_map": {"a": "x"}, "weight_map": {}}', "key 'weight_map' appears twice"),
    ('{"weight_map": {"a": NaN}}', "NaN is not a JSON number"),
    ('{"metadata": 3, "weight_map": {"a": "model-00001-of-00002.safetensors"}}', "'metadata' is not an object"),
    ('{"weight_map": {"not.there": "model-00001-of-00002.safetensors"}}', "does not hold it"),
])
def test_index_problems_are_named(sharded, index, words):
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    index_path = sharded / integrity.INDEX_FILE
    original = index_path.read_text()
    index_path.write_text(index.replace("model-00001-of-00002.safetensors", shards[0]))
    try:
        with pytest.raises(IntegrityError) as ei:
            integrity.scan(sharded)
    finally:
        index_path.write_text(original)
    assert words in str(ei.value) and integrity.INDEX_FILE in str(ei.value)


def test_export_carries_only_contained_files(tiny_llama_dir, tmp_path):
    from calib import export
    from calib.scales.fold import LayerScales

    (tiny_llama_dir / "tokenizer.json").symlink_to("/etc/hostname")
    s = {i: LayerScales(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0), k_amax=torch.tensor(448.0),
                        v_amax=torch.tensor(448.0)) for i in range(3)}
    with pytest.raises(export.ExportError, match="outside the model folder"):
        export.export_vllm(tiny_llama_dir, tmp_path / "out", s, {})
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    os.unlink(tiny_llama_dir / "tokenizer.json")
    out = export.export_vllm(tiny_llama_dir, tmp_path / "out", s, {})
    written = integrity.scan(out)
    index = json.loads((out / integrity.INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == written.total_size


# ---------------------------------------------------------------- geometry

def _llama_runs(cfg: dict) -> bool:
    """Build a one-layer Llama from `cfg` and run three tokens through it (the independent reference).
    True also when Llama's own config validation refuses `cfg` (preflight turns that into one line)."""
    from transformers import LlamaConfig, LlamaModel

    try:
        config = LlamaConfig(vocab_size=11, intermediate_size=8, **cfg)
    except Exception as e:
        assert "not a multiple" in str(e)
        return True
    model = LlamaModel(config).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state
    return tuple(out.shape) == (1, 3, cfg["hidden_size"]) and bool(torch.isfinite(out).all())


@settings(max_examples=40, deadline=None)
@given(st.fixed_dictionaries({"num_hidden_layers": st.just(1), "num_attention_heads": st.integers(-1, 6),
                              "num_key_value_heads": st.integers(0, 6), "hidden_size": st.integers(0, 24),
                              "rope_theta": st.just(10000.0)},
                             optional={"head_dim": st.integers(-1, 9) | st.none()}))
def test_every_geometry_we_accept_runs(cfg):
    try:
        geometry.check(cfg, "config.json")
    except geometry.GeometryError as e:
        assert str(e).startswith("config.json: field '") or "RoPE" in str(e)
        return
    assert _llama_runs(cfg)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                        "hidden_size", "head_dim", "vocab_size", "layer_types", "sliding_window",
                                        "partial_rotary_factor", "rope_theta", "text_config", "n_head"]),
                       st.one_of(st.integers(-2, 2**40), st.floats(), st.booleans(), st.none(), st.text(max_size=4),
                                 st.lists(st.text(max_size=3), max_size=3),
                                 st.dictionaries(st.sampled_from(["hidden_size", "num_attention_heads"]),
                                                 st.integers(-1, 10))),
                       max_size=6))
def test_any_config_is_accepted_or_one_line_error(cfg):
    try:
        geometry.check(cfg, "M/config.json")
    except geometry.GeometryError as e:
        assert str(e).startswith("M/config.json: ") and "\n" not in str(e)


def test_real_architectures_pass(tmp_path):
    from tiny import ARCHS, tiny_config

    for arch in ARCHS:
        tiny_config(arch).save_pretrained(tmp_path / arch)
        geometry.check(json.loads((tmp_path / arch / "config.json").read_text()), arch)


def test_odd_rotary_dimension_is_refused():
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 60, "rope_theta": 1e4}
    with pytest.raises(geometry.GeometryError, match="RoPE rotates 15 channels"):
        geometry.check(cfg, "c")
    with pytest.raises(Exception):
        _llama_runs({"num_hidden_layers": 1, **cfg})   # the model agrees: it cannot run


# ---------------------------------------------------------------- load report (calib.model.load)

def test_load_refuses_missing_tensors_instead_of_random_init(tiny_llama_dir):
    from safetensors.torch import load_file

    from calib.model import load as M

    tensors = load_file(tiny_llama_dir / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.2.self_attn.k_proj" not in k},
              str(tiny_llama_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(M.ModelError, match=r"lack 1 tensor\(s\) config.json needs \(layers.2.self_attn.k_proj.weight\)"):
        M.load(tiny_llama_dir, device="cpu")


def test_quantized_weights_with_a_quantization_config_are_not_refused(tiny_llama_dir, tmp_path):
    from calib.model import load as M
    from tiny import fp8_weight_checkpoint

    ckpt = fp8_weight_checkpoint(tiny_llama_dir, tmp_path / "fp8")
    M.check_weights(ckpt, json.loads((ckpt / "config.json").read_text()))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config")
    with pytest.raises(M.ModelError, match="F8_E4M3 values"):
        M.check_weights(ckpt, cfg)


def test_tied_embeddings_are_counted_once_by_the_size_check(tmp_path):
    """A model with tied input/output embeddings stores them once: the check before loading must not count the
    LM head as missing weights (the embedded default, SmolLM2, ties them)."""
    from calib.evaluation.run import load_causal_lm
    from calib.model.load import ModelError
    from tiny import tiny_causal_lm

    tiny_causal_lm("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    loaded = load_causal_lm(str(tmp_path / "tied"), "cpu")
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    cfg = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(ModelError, match="describes"):              # untied, the head really is missing
        load_causal_lm(str(tmp_path / "tied"), "cpu")
