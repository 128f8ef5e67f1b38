"""The runner's reading of vLLM's KV cache groups (calib/engine/vllm_capacity.py `kv_groups`, loaded beside the
runner) from engine objects shaped like vLLM 0.24's and 0.32's, without vLLM: the tokens in flight a sliding layer reserves come from
`VllmConfig.max_in_flight_tokens` where the version has it (0.32) and from the scheduler's max_num_batched_tokens
where not (0.24), and a number a version does not keep costs that number, not the groups. Fast, CPU only."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from calib.engine import answer
from calib.evaluation import markdown, memory
from calib.evaluation.results import ArmInfo
from calib.model import layer_kinds as lk
from helpers import engine_script

GLOBAL = (5, 11, 17, 23, 29)
SLIDING = tuple(i for i in range(34) if i not in GLOBAL)


@pytest.fixture
def runner(monkeypatch):
    """The engine-side reader (calib/engine/vllm_capacity.py), loaded as the runner's python loads it."""
    return engine_script(monkeypatch, "vllm_capacity")


class SlidingWindowSpec(SimpleNamespace):       # named as vLLM's classes: the runner reports type(spec).__name__
    pass


class FullAttentionSpec(SimpleNamespace):
    pass


def _engine(version: str, cache: dict | None = None, scheduler: dict | None = None):
    """An `LLM` shaped like vLLM `version`'s with the engine core in process: Gemma-3-4B's shape (29 sliding layers of
    window 1024, 5 global; 4 KV heads x 256), FP8 with the sliding layers kept bf16, a 16 GiB pool, max_model_len
    32768, as GPU vLLM 0.24 ran it: 52,428 blocks; the sliding layers in 6 groups (the last of 4 layers), the global
    layers' FP8 blocks enlarged to 32 tokens so every page is 64 KiB (v1/core/kv_cache_utils.py)."""
    name = "model.layers.{}.self_attn.attn".format
    groups = [SimpleNamespace(layer_names=[name(i) for i in SLIDING[j::6]],
                              kv_cache_spec=SlidingWindowSpec(block_size=16, page_size_bytes=65536,
                                                              dtype="torch.bfloat16", sliding_window=1024))
              for j in range(6)]
    groups.append(SimpleNamespace(layer_names=[name(i) for i in GLOBAL],
                                  kv_cache_spec=FullAttentionSpec(block_size=32, page_size_bytes=65536,
                                                                  dtype="torch.uint8", sliding_window=None,
                                                                  attention_chunk_size=None)))
    cfg = SimpleNamespace(model_config=SimpleNamespace(max_model_len=32768),
                          cache_config=SimpleNamespace(**(cache if cache is not None else
                                                          {"kv_cache_size_tokens": 227303,
                                                           "kv_cache_max_concurrency": 6.9367557554908705})),
                          scheduler_config=SimpleNamespace(**(scheduler if scheduler is not None else
                                                              {"max_num_batched_tokens": 16384})))
    if version == "0.32":       # VllmConfig.max_in_flight_tokens: 2 batches in flight (async scheduling) x 16384
        cfg.max_in_flight_tokens = 32768
    kcc = SimpleNamespace(num_blocks=52428, kv_cache_groups=groups)
    core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=SimpleNamespace(kv_cache_config=kcc)))
    return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg, engine_core=core))


def _model() -> memory.Model:
    layers = lk.layer_kinds({"num_hidden_layers": 34, "sliding_window": 1024,
                             "layer_types": ["full_attention" if i in GLOBAL else "sliding_attention"
                                             for i in range(34)]})
    return memory.Model(layers, 4, 256, "bfloat16", (32768,), "m")


SKIP_SLIDING = ArmInfo("default", "fp8_e4m3", "tensor", True, None, SLIDING, (), (),
                       {"k": {str(i): 1.0 for i in GLOBAL}, "v": {}, "q": {}}, "sliding_window")


def test_vllm_024_in_flight_tokens_are_the_schedulers_batch(runner):
    got = runner.kv_groups(_engine("0.24"))
    assert got["in_flight_tokens"] == 16384
    assert (got["size_tokens"], got["max_model_len"], got["num_blocks"]) == (227303, 32768, 52428)
    assert got["max_concurrency"] == pytest.approx(6.9367557554908705)
    assert [g["layers"] for g in got["groups"]] == [list(SLIDING[j::6]) for j in range(6)] + [list(GLOBAL)]
    assert len(got["groups"][5]["layers"]) == 4               # the padded sliding group
    assert got["groups"][0] == {"layers": list(SLIDING[0::6]), "spec": "SlidingWindowSpec", "block_size": 16,
                                "page_bytes": 65536, "dtype": "bfloat16", "window": 1024}
    assert got["groups"][6] == {"layers": list(GLOBAL), "spec": "FullAttentionSpec", "block_size": 32,
                                "page_bytes": 65536, "dtype": "uint8", "window": None}
    # through the protocol and the check: the bytes model predicts the engine's capacity in its own definition
    checked = answer.kv_groups(json.loads(json.dumps(got)))
    assert memory.engine_check(_model(), SKIP_SLIDING, checked) == {
        "engine": 227303, "bytes_model": 227303, "max_model_len": 32768, "problems": []}


def test_vllm_032_in_flight_tokens_are_the_configs_own(runner):
    got = runner.kv_groups(_engine("0.32"))
    assert got["in_flight_tokens"] == 32768          # max_in_flight_tokens, not the scheduler's 16384
    assert got["groups"] == runner.kv_groups(_engine("0.24"))["groups"]


def test_a_number_the_engine_does_not_keep_costs_only_that_number(runner):
    got = runner.kv_groups(_engine("0.24", cache={}))      # no kv_cache_size_tokens / kv_cache_max_concurrency
    assert got["size_tokens"] is None and got["max_concurrency"] is None and len(got["groups"]) == 7
    checked = answer.kv_groups(json.loads(json.dumps(got)))
    c = memory.engine_check(_model(), SKIP_SLIDING, checked)
    assert c == {"engine": None, "bytes_model": 227303, "max_model_len": 32768, "problems": []}
    assert "not reported vs 227,303 at 32,768" in "\n".join(markdown.memory_lines(
        {"layer_kinds": "k", "note": "n", "rows": {"a": {"model": {"32768": {"tokens_per_gib": 1.0, "saving": 0.5}},
                                                          "engine_check": c}}}))
    # neither max_in_flight_tokens nor the scheduler's batch: no prediction, and the check says why
    got = runner.kv_groups(_engine("0.24", scheduler={}))
    assert got["in_flight_tokens"] is None and got["size_tokens"] == 227303
    c = memory.engine_check(_model(), SKIP_SLIDING, answer.kv_groups(got))
    assert c["bytes_model"] is None and c["problems"] == [
        "the engine did not say the tokens in flight a sliding or chunked layer reserves"]


def test_no_groups_where_the_engine_core_runs_elsewhere(runner):
    llm = _engine("0.24")
    llm.llm_engine.engine_core = SimpleNamespace()          # the engine core in another process
    assert runner.kv_groups(llm) is None


def test_the_engine_table_states_the_context_capacity_beside_the_pool():
    """The H100 run of the Gemma-3-4B shape: pool 838,848 tokens (one group's blocks), the engine's own capacity
    200,330 context tokens at max_model_len 32,800; an engine that did not say it shows a dash, not the pool."""
    from calib.evaluation import engine_report

    assert engine_report.context_capacity({"size_tokens": 200330, "max_model_len": 32800}) == \
        "200,330 at max_model_len 32,800"
    assert engine_report.context_capacity(None) == "–"
    assert engine_report.context_capacity({"size_tokens": None, "max_model_len": 32800}) == "–"
