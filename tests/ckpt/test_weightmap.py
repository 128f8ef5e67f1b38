"""calib.ckpt.weightmap: the one parser and writer of `model.safetensors.index.json`. The model checks
(integrity.scan, an error) and the checkpoint reader (verify/inspect, a problem) report the same finding."""

from __future__ import annotations

import json

import pytest
import torch

from calib import export
from calib.ckpt import integrity
from calib.ckpt import weightmap
from calib.ckpt.names import INDEX_FILE, SCALES_FILE
from calib.ckpt.reader import CheckpointFiles
from helpers import made_up_scales


@pytest.mark.parametrize("index, why", [
    ([], "no weight_map object"),
    ({"weight_map": {}}, "no weight_map object"),
    ({"weight_map": [["a", "b"]]}, "no weight_map object"),
    ({"weight_map": {"a": "x.safetensors", "b": 3}}, "tensor 'b' maps to 3, not a file name"),
])
def test_bad_weight_maps_are_named(index, why):
    with pytest.raises(weightmap.WeightMapError, match=why):
        weightmap.parse(index)


def test_metadata_is_an_object_or_absent():
    assert weightmap.metadata({"weight_map": {}}) == {} and weightmap.metadata({"metadata": None}) == {}
    assert weightmap.metadata({"metadata": {"total_size": 4}}) == {"total_size": 4}
    with pytest.raises(weightmap.WeightMapError, match="'metadata' is not an object"):
        weightmap.metadata({"metadata": 3})


def test_the_written_index_is_what_both_readers_read(tiny_llama_dir, tmp_path):
    """The exporter's index (weightmap.document) parses back to the map integrity.scan and the reader both see,
    and its total_size is the tensors' bytes counted from the shard headers."""
    out = export.export_vllm(tiny_llama_dir, tmp_path / "out", made_up_scales(3), {})
    doc = json.loads((out / INDEX_FILE).read_text())
    wmap = weightmap.parse(doc)
    assert wmap == integrity.scan(out).weight_map == CheckpointFiles(out).index
    assert sum(v == SCALES_FILE for v in wmap.values()) == 6 and list(wmap) == sorted(wmap)
    assert weightmap.metadata(doc)["total_size"] == integrity.scan(out).total_size
    assert weightmap.document(wmap, 7) == {"metadata": {"total_size": 7}, "weight_map": wmap}


@pytest.mark.parametrize("index", [{"weight_map": {}}, {"weight_map": {"model.embed_tokens.weight": None}}])
def test_both_readers_report_the_same_finding(tiny_llama_dir, tmp_path, index):
    out = export.export_vllm(tiny_llama_dir, tmp_path / "out", made_up_scales(3), {})
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(weightmap.WeightMapError) as parsed:
        weightmap.parse(index)
    with pytest.raises(integrity.IntegrityError) as scanned:
        integrity.scan(out)
    assert str(parsed.value) in str(scanned.value) and INDEX_FILE in str(scanned.value)
    assert CheckpointFiles(out).index is None and CheckpointFiles(out).index_error == f"{INDEX_FILE}: {parsed.value}"
