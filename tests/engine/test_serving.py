"""Serving metrics (calib/engine/serving.py) against brute force: percentiles against numpy, TPOT without the
first token, ITL as every gap, throughput over the run's wall time, the largest batch the KV capacity holds,
and the checks on the runner's untrusted answer."""

from __future__ import annotations

import random

import numpy as np
import pytest

from calib.engine import protocol, serving


def test_percentile_is_numpys_linear_interpolation():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert serving.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert serving.percentile([], 50) is None
    d = serving.distribution([3.0, 1.0, 2.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}


def _group(reqs, bucket=64):
    return {"bucket": bucket, "max_running": 2,
            "requests": [{"added": a, "token_times": t, "prompt_tokens": 60, "preemptions": 0} for a, t in reqs]}


def test_ttft_tpot_itl_e2e_and_throughput_by_brute_force():
    rng = random.Random(1)
    reqs = []
    for r in range(9):
        added = rng.uniform(0, 5)
        t, times = added + rng.uniform(0.1, 1.0), []
        for _ in range(5):
            times.append(t)
            t += rng.choice([0.0, rng.uniform(0.01, 0.2)])      # two tokens of one step share its time
        reqs.append((added, times))
    s = serving.group_summary(_group(reqs), concurrency=3, output_tokens=5, capacity=1000)
    ttft = [ts[0] - a for a, ts in reqs]
    tpot = [sum(ts[k + 1] - ts[k] for k in range(4)) / 4 for _, ts in reqs]       # the first token excluded
    itl = [ts[k + 1] - ts[k] for _, ts in reqs for k in range(4)]
    e2e = [ts[-1] - a for a, ts in reqs]
    for key, ref in (("ttft_s", ttft), ("tpot_s", tpot), ("itl_s", itl), ("e2e_s", e2e)):
        for q in (50, 90, 99):
            assert s[key][f"p{q}"] == pytest.approx(float(np.percentile(ref, q)), rel=1e-9, abs=1e-12), key
        assert s[key]["mean"] == pytest.approx(float(np.mean(ref)))
    wall = max(ts[-1] for _, ts in reqs) - min(a for a, _ in reqs)
    assert s["wall_s"] == pytest.approx(wall)
    assert s["request_throughput"] == pytest.approx(9 / wall) and s["output_throughput"] == pytest.approx(45 / wall)
    assert s["output_tokens"] == s["output_tokens_asked"] == 45 and s["completed"] == 9
    assert s["largest_batch_fits"] == 1000 // (60 + 5) and s["request_preemptions"] == 0


def test_the_largest_batch_is_the_engines_count_where_it_reported_its_groups():
    """A hybrid model's pool in tokens counts one group's blocks: with the engine's groups the batch is its own
    count (calib.model.layer_kinds.engine_requests_fit), not the pool over the request's tokens."""
    reqs = [(0.0, [1.0, 1.1, 1.2, 1.3, 1.4]) for _ in range(2)]
    groups = {"num_blocks": 52428, "in_flight_tokens": 16384, "groups": [
        {"layers": [j], "spec": "SlidingWindowSpec", "block_size": 16, "window": 1024} for j in range(6)] + [
        {"layers": [6], "spec": "FullAttentionSpec", "block_size": 16, "window": None}]}
    group = _group(reqs, bucket=8192)
    for r in group["requests"]:
        r["prompt_tokens"] = 8219
    plain = serving.group_summary(group, concurrency=2, output_tokens=5, capacity=52428 * 16)
    engine = serving.group_summary(group, concurrency=2, output_tokens=5, capacity=52428 * 16, kv_groups=groups)
    assert plain["largest_batch_fits"] == 52428 * 16 // 8224 == 102
    assert engine["largest_batch_fits"] == 52428 // (514 + 6 * 515) == 14


def test_a_short_request_is_not_completed_and_speed_says_no():
    field = {"concurrency": 2, "output_tokens": 3, "groups": [{"bucket": 64, "samples": [0], "requests": 2}]}
    raw = {"groups": [_group([(0.0, [1.0, 1.1, 1.2]), (0.0, [1.0, 1.1])])], "error": None, "oom": False,
           "on_cpu": True, "device": "CPU", "preemptions": 0, "peak_memory_bytes": 1 << 30,
           "memory_kind": "process peak RSS"}
    entry = serving.summarize(serving.check(raw, field, 128), field, capacity=4096)
    assert entry["label"] == "CPU" and entry["buckets"]["64"]["completed"] == 1
    assert entry["incomplete_buckets"] == ["64"]
    assert serving.speed_ok(entry)[0] is False
    raw["groups"][0]["requests"][1]["token_times"].append(1.3)
    entry = serving.summarize(serving.check(raw, field, 128), field, capacity=4096)
    assert serving.speed_ok(entry) == (True, "no preemption or OOM at concurrency 2")
    raw["preemptions"] = 3
    assert serving.speed_ok(serving.summarize(serving.check(raw, field, 128), field, 4096))[0] is False
    raw["preemptions"], raw["error"], raw["oom"] = None, "OutOfMemoryError: CUDA out of memory", True
    ok, why = serving.speed_ok(serving.summarize(serving.check(raw, field, 128), field, 4096))
    assert ok is False and "out of memory" in why


def test_preemptions_fall_back_to_per_request_counts_then_say_not_reported():
    field = {"concurrency": 1, "output_tokens": 2, "groups": [{"bucket": 8, "samples": [0], "requests": 1}]}
    raw = {"groups": [_group([(0.0, [1.0, 2.0])])], "preemptions": None}
    assert serving.summarize(serving.check(raw, field, 64), field, None)["preemptions"] == 0
    raw["groups"][0]["requests"][0]["preemptions"] = None
    entry = serving.summarize(serving.check(raw, field, 64), field, None)
    assert entry["preemptions"] is None and entry["preemptions_source"] == "not reported by this vLLM"
    assert serving.speed_ok(entry) == (True, "no OOM; preemptions not reported by this vLLM")


@pytest.mark.parametrize("bad, match", [
    ({"groups": [{"requests": [{"added": 1.0, "token_times": [0.5], "prompt_tokens": 4}]}]}, "not in order"),
    ({"groups": [{"requests": [{"added": 0.0, "token_times": [1, 2, 3, 4], "prompt_tokens": 4}]}]}, "at most 3"),
    ({"groups": [{"requests": [{"added": float("nan"), "token_times": [], "prompt_tokens": 4}]}]}, "added"),
    ({"groups": [{"requests": [{"added": 0.0, "token_times": [], "prompt_tokens": 10 ** 9}]}]}, "prompt_tokens"),
    ({"groups": [{"requests": []}, {"requests": []}]}, "at most 1 groups"),
    ({"peak_memory_bytes": -1}, "peak_memory_bytes"),
    ([], "expected an object"),
])
def test_a_bad_serving_answer_names_its_field(bad, match):
    field = {"concurrency": 1, "output_tokens": 3, "groups": [{"bucket": 8, "samples": [0], "requests": 1}]}
    with pytest.raises(serving.ServingError, match=match):
        serving.check(bad, field, 64)


def test_request_field_groups_samples_by_bucket_and_sizes_requests():
    f = serving.request_field(serving.ServingSpec(concurrency=3, output_tokens=4), [64, 128, 256], [64, 128, 64])
    assert f == {"concurrency": 3, "output_tokens": 4, "groups": [
        {"bucket": 64, "samples": [0, 2], "requests": 6}, {"bucket": 128, "samples": [1], "requests": 6}]}
    assert serving.ServingSpec(concurrency=0, output_tokens=1).problems()[0].startswith("--concurrency 0")
    assert serving.ServingSpec(concurrency=1, output_tokens=1).problems()[0].startswith("--output-tokens 1")
    assert serving.config_key({"kv_cache_dtype": "fp8", "skip_layers": [3, 1]}) == "kv=fp8 skip=[1,3]"


def test_the_response_cap_grows_with_the_serving_phase():
    req = {"samples": [[1, 2, 3]], "top_k": 2, "continuation_tokens": 1, "passkey": [], "passkey_tokens": 1,
           "arms": [{"scales": None}]}
    field = serving.request_field(serving.ServingSpec(concurrency=8, output_tokens=512), [64], [64])
    assert protocol.response_cap({**req, "serving": field}) > protocol.response_cap(req) + 16 * 512 * 32


def test_a_skip_list_of_layer_numbers_and_kind_names_has_one_key_per_set():
    """vLLM's skip flag takes layer numbers and names ("sliding_window"): a checkpoint with layer skips on a hybrid
    model mixes them, and the key must not depend on the order the list was built in (nor crash on it)."""
    key = serving.config_key({"kv_cache_dtype": "fp8", "skip_layers": ["sliding_window", 10, 3]})
    assert key == serving.config_key({"kv_cache_dtype": "fp8", "skip_layers": [3, "sliding_window", 10]})
    assert key == "kv=fp8 skip=[3,10,sliding_window]"
