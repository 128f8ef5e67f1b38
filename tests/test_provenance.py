"""The run's record: kvcalib.json, the statistics header and the resume header are one Provenance written
three ways; files in the shapes kvcalib has always written read back into the same fields."""

from __future__ import annotations

import dataclasses
import json

import pytest

from calib.provenance import RECORD, RESUME, STATS, Provenance, ProvenanceError, Written, record_field, text_or_none

RUN = Provenance(created="2026-01-02T03:04:05+00:00", model="org/model", model_config_sha256="sha256:ab",
                 data={"source": "d.jsonl", "samples": 4, "tokens": 96, "fingerprint": "sha256:cd"},
                 recipe={"dtype": "fp8_e4m3", "granularity": "head"}, skipped_layers=(1,),
                 calibration_dtype="float32", versions={"kvcalib": "0.1.0"},
                 layers={"0": {"k_amax": 2.0, "k_scale": 0.5}}, rotary_dim=16)


def test_each_file_holds_the_keys_kvcalib_has_always_written():
    assert list(RUN.to_dict(RECORD)) == ["producer", "created", "model", "data", "recipe", "skipped_layers",
                                         "calibration_dtype", "versions", "layers", "rotary_dim"]
    assert RUN.stats_header() == {"producer": "kvcalib", "model": "org/model", "model_config_sha256": "sha256:ab",
                                  "rotary_dim": 16, "recipe": RUN.recipe, "data": RUN.data,
                                  "versions": {"kvcalib": "0.1.0"}}
    assert RUN.resume_header(batches_done=3) == {"recipe": RUN.recipe, "model_config_sha256": "sha256:ab",
                                                 "data_source": "d.jsonl", "rotary_dim": 16, "batches_done": 3}
    assert RUN.replace(into="q").to_dict()["into"] == "q" and "into" not in RUN.to_dict()


def test_every_shape_reads_back_into_the_same_fields():
    for file, fields in ((RECORD, ["created", "model", "data", "recipe", "skipped_layers", "calibration_dtype",
                                   "versions", "layers", "rotary_dim"]),
                         (STATS, ["model", "model_config_sha256", "data", "recipe", "versions", "rotary_dim"]),
                         (RESUME, ["model_config_sha256", "recipe", "rotary_dim", "data_source"])):
        back = Provenance.from_dict(json.loads(json.dumps(RUN.to_dict(file))), "x", file)
        assert {f: getattr(back, f) for f in fields} == {f: getattr(RUN, f) for f in fields}, file


def test_a_kvcalib_json_written_before_loads_with_its_engine_notes_and_writes_back_the_same():
    """The TensorRT-LLM variant's record as kvcalib wrote it before Provenance existed (a dict extended by the
    writers): every key keeps its value, the writer's own become `written`."""
    old = {"producer": "kvcalib", "created": "2025-11-30T10:00:00+00:00", "model": "m", "data": {"source": "d"},
           "recipe": {"dtype": "int8"}, "skipped_layers": [], "calibration_dtype": "bfloat16",
           "versions": {"kvcalib": "0.0.9"}, "layers": {"0": {"k_amax": 1.0}}, "rotary_dim": 64,
           "target": "trtllm", "kv_cache_quant_algo": "INT8", "trtllm_int8_layer_scale": {"0": 0.25},
           "weights": ["link"]}
    prov = Provenance.from_dict(old, "kvcalib.json")
    assert prov.written == Written("trtllm", ("link",), {"kv_cache_quant_algo": "INT8",
                                                          "trtllm_int8_layer_scale": {"0": 0.25}})
    assert prov.rotary_dim == 64 and prov.skipped_layers == () and prov.calibration_dtype == "bfloat16"
    assert prov.to_dict() == old
    stats_only = Provenance.from_dict({**RUN.to_dict(), "target": None})
    assert stats_only.written == Written(None) and stats_only.to_dict() == {**RUN.to_dict(), "target": None}


@pytest.mark.parametrize("key, value, words", [
    ("model", 3, "field 'model' must be text or null"), ("data", [1], "field 'data' must be a JSON object"),
    ("rotary_dim", -1, "field 'rotary_dim' must be a non-negative integer"),
    ("skipped_layers", ["x"], "field 'skipped_layers' must be a list of layer indices"),
    ("target", 1, "field 'target' must be text or null")])
def test_a_field_of_the_wrong_kind_is_named(key, value, words):
    with pytest.raises(ProvenanceError, match=f"^kvcalib.json: {words}"):
        Provenance.from_dict({**RUN.to_dict(), key: value}, "kvcalib.json")


def test_a_new_field_is_one_declaration():
    """Declared once with the files it goes into: written there, read back, and absent from older files."""
    @dataclasses.dataclass(frozen=True)
    class More(Provenance):
        fingerprint: str | None = record_field(None, RECORD, STATS, check=text_or_none, omit_none=True)

    run = More(**{f.name: getattr(RUN, f.name) for f in dataclasses.fields(Provenance)}, fingerprint="sha256:ef")
    assert run.to_dict()["fingerprint"] == run.stats_header()["fingerprint"] == "sha256:ef"
    assert "fingerprint" not in run.resume_header()
    assert More.from_dict(run.stats_header(), "s", STATS).fingerprint == "sha256:ef"
    assert More.from_dict(RUN.to_dict()).fingerprint is None
