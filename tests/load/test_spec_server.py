"""The load spec's checks and sweep levels (calib/load/spec.py), and what kvcalib reads from vLLM's server
(calib/load/server.py): its capacity log lines (0.24 and 0.32 wordings), its metrics page, its command lines."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest

from calib.engine import command
from calib.load import server
from calib.load.spec import LoadSpec


@pytest.mark.parametrize("spec, flag", [
    (LoadSpec(output_tokens=1), "--output-tokens = 1"),
    (LoadSpec(concurrency=(4, 0)), "--concurrency = 0"),
    (LoadSpec(concurrency=(4, 4)), "given twice"),
    (LoadSpec(slo_ttft_ms=math.inf), "--slo-ttft-ms = inf"),
    (LoadSpec(slo_tpot_ms=float("nan")), "--slo-tpot-ms = nan"),
    (LoadSpec(slo_tpot_ms=-5), "--slo-tpot-ms = -5"),
    (LoadSpec(noise=1.5), "--speed-noise = 1.5"),
    (LoadSpec(budget_s=math.inf), "--sweep-minutes = inf"),
    (LoadSpec(max_concurrency=True), "--max-concurrency = True"),
])
def test_bad_load_options_name_the_flag(spec, flag):
    assert flag in spec.problems()[0]


def test_defaults_are_valid():
    assert LoadSpec().problems() == [] and LoadSpec(noise=0).problems() == []


def _sweep(spec, throughput, fits):
    done, level = [], spec.next_level([], fits, 0.0)
    while level is not None:
        done.append((level, throughput(level)))
        level = spec.next_level(done, fits, 0.0)
    return [c for c, _ in done]


def test_the_sweep_goes_past_the_pool_and_stops_when_saturated():
    # throughput grows with the batch until the pool (6 requests) binds, then stays
    levels = _sweep(LoadSpec(), lambda c: float(min(c, 6)), fits=6)
    assert levels == [1, 2, 4, 8, 16]           # 16 > 2 x 6: past the pool, and flat since 8


def test_a_compute_bound_sweep_stops_at_saturation_when_the_pool_is_out_of_reach():
    levels = _sweep(LoadSpec(max_concurrency=64), lambda c: float(min(c, 3)), fits=10_000)
    assert levels == [1, 2, 4, 8, 16]          # flat over two doublings (4 -> 8 -> 16)


def test_explicit_levels_are_measured_as_given_and_the_cap_holds():
    assert _sweep(LoadSpec(concurrency=(8, 2)), lambda c: 1.0, fits=None) == [8, 2]
    assert _sweep(LoadSpec(max_concurrency=4), lambda c: float(c), fits=None) == [1, 2, 4]


def test_the_budget_stops_before_a_level_that_would_pass_it():
    spec = LoadSpec(budget_s=100)
    assert spec.next_level([(1, 1.0), (2, 2.0)], None, 40.0) == 4
    assert spec.next_level([(1, 1.0), (2, 2.0)], None, 60.0) is None


def test_capacity_lines_of_both_vllm_versions():
    v032 = ("(EngineCore pid=1) INFO [kv_cache_utils.py:1] GPU KV cache size: 253,949 tokens, Maximum concurrency "
            "for 16,272 tokens per request: 15.61x")
    v024 = ("INFO [kv_cache_utils.py:1] GPU KV cache size: 232,825 tokens\n"
            "INFO [kv_cache_utils.py:2] Maximum concurrency for 16,272 tokens per request: 14.30x")
    assert server.capacity(v032) == {"kv_cache_tokens": 253949, "max_model_len": 16272, "max_concurrency": 15.61,
                                     "requests_fit": 15}
    assert server.capacity(v024)["requests_fit"] == 14
    assert server.capacity("no such line") == {"kv_cache_tokens": None, "max_model_len": None,
                                               "max_concurrency": None, "requests_fit": None}


def test_metrics_page_sums_label_sets_and_ignores_the_rest():
    page = "\n".join([
        "# HELP vllm:num_requests_running Number of requests",
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.93',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
        'vllm:prompt_tokens_total{engine="0"} 1e6',
        'vllm:num_requests_waiting{engine="0"} NaN',
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0",num_gpu_blocks="1234"} 1.0',
    ])
    assert server.parse_metrics(page) == {"vllm:num_requests_running": 8.0, "vllm:num_requests_waiting": 3.0,
                                          "vllm:kv_cache_usage_perc": 0.93, "vllm:num_preemptions_total": 2.0}
    assert server.cache_info(page)["num_gpu_blocks"] == "1234"


def test_serve_command_lines():
    cfg = server.ServeConfig("/m/ckpt", "fp8", ("sliding_window", 3))
    assert cfg.command() == "vllm serve /m/ckpt --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window 3"
    # the engine's flag names come from the one command builder; a path a shell would split is quoted
    spaced = server.ServeConfig("/m/my ckpt", "fp8_per_token_head", (), "TRITON_ATTN")
    assert shlex.split(spaced.command()) == [*command.argv("vllm", "/m/my ckpt"), *command.spelled(
        "vllm", "fp8_per_token_head", (), "TRITON_ATTN")] == ["vllm", "serve", "/m/my ckpt", "--kv-cache-dtype",
                                                              "fp8_per_token_head", "--attention-backend", "TRITON_ATTN"]
    gpu = server.argv(Path("/v"), cfg, server.Launch(16_272, 4), 8000)
    assert gpu[:3] == ["/v/bin/python", str(server.CLI), "serve"]
    assert gpu[gpu.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)
    assert gpu[gpu.index("--max-model-len") + 1] == "16272" and "--no-enable-prefix-caching" in gpu
    assert "--max-num-seqs" not in gpu and "--enforce-eager" not in gpu      # users' defaults: CUDA graphs
    cpu = server.argv(Path("/v"), server.ServeConfig("/m"), server.Launch(512, 1, on_cpu=True), 8000)
    assert "--kv-cache-memory-bytes" not in cpu and "--kv-cache-dtype" not in cpu
    assert server.env(server.Launch(512, 2, on_cpu=True), Path("/t"))["VLLM_CPU_KVCACHE_SPACE"] == "2"
