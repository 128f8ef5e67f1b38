"""A hybrid-attention model (sliding-window and global layers): eval adds the sliding-window skip arms on its own,
the bytes model prices them, and the verdict weighs every measured skip by the memory it gives back."""

from __future__ import annotations

import json
import math
from dataclasses import replace as dc_replace

import pytest

from calib.engine.run import request_arm
from calib.evaluation import markdown, memory
from calib.evaluation import verdict as report
from calib.evaluation.run import run_eval
from calib.model import layer_kinds as lk
from helpers import arm_metrics, boosted, engine_numbers, eval_config, reference_metrics, save_model_and_data
from tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    model = boosted(tiny_causal_lm("gemma3", num_hidden_layers=4, sliding_window=8, scale_k=30.0,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"]))
    src, data = save_model_and_data(tmp, model, "gemma3")
    res = run_eval(eval_config(src, data, tmp / "report", samples=12, passkey_trials=0))
    return res, src


def test_eval_adds_the_sliding_window_arm(gemma3):
    res, src = gemma3
    arm = res.arms["default skip sliding_window"]
    assert arm.info.skip == (0, 1, 2) and arm.info.skip_kind == "sliding_window"
    assert sorted(arm.info.scales["k"]) == ["3"]            # only the global layer is quantised
    assert sorted(arm.layers) == ["3"] and sorted(res.arms["default"].layers) == ["0", "1", "2", "3"]
    # the emulated global layer sees exactly the inputs it sees in the default arm up to its own layer: its K SNR
    # differs (the sliding layers' outputs changed), but the skipped arm is closer to the reference
    assert arm.summary.kl < res.arms["default"].summary.kl
    doc = json.loads((res.out / "report.json").read_text())
    assert doc["arms"]["default skip sliding_window"]["skip_kind"] == "sliding_window"
    assert "3 sliding_window (window 8)" in " ".join(doc["notes"])


def test_memory_table_is_the_bytes_model(gemma3):
    res, src = gemma3
    doc = json.loads((res.out / "report.json").read_text())
    rows = doc["memory"]["rows"]
    # 4 layers, 2 KV heads x 16, fp32 model (tiny): at 64 tokens the sliding layers hold 8 tokens each
    per_token = 2 * 2 * 16
    full = (3 * 8 + 64) * per_token * 4
    assert rows["fp32"]["model"]["64"]["bytes_per_sequence"] == full
    assert rows["default"]["model"]["64"]["bytes_per_sequence"] == full // 4
    assert rows["default skip sliding_window"]["model"]["64"]["bytes_per_sequence"] == \
        (3 * 8 * 4 + 64 * 1) * per_token
    assert "ppl loss" in doc["verdict"]["text"] and doc["verdict"]["skips_by_memory"][0]["label"] == \
        "skip sliding-window layers"
    assert "## KV memory" in (res.out / "report.md").read_text()


def test_engine_serves_the_arm_by_kind(gemma3):
    from calib.evaluation.arms import Geometry, default_arm, sliding_skip_arms
    from calib.recipe.dtypes import FP8_E4M3

    arms = sliding_skip_arms([default_arm(Geometry((0, 1, 2, 3), 2, 16), FP8_E4M3)], (0, 1, 2))
    spec = request_arm(arms[0], "m")
    assert spec["skip_layers"] == ["sliding_window"] and spec["kv_cache_dtype"] == "fp8"


def _bytes_model():
    layers = lk.layer_kinds({"num_hidden_layers": 18, "sliding_window": 512, "sliding_window_pattern": 6})
    return memory.Model(layers, 1, 256, "bfloat16", (8192, 32768), "m")


def _arm(rel, skip=(), kind=None, layers=range(18), nll=(), size=None):
    """An FP8 arm of `_bytes_model`'s 18 layers: perplexity loss `rel` at 32K, scales on `layers` (the rest kept
    unquantised), per-sample NLL `nll`, and the engine's capacity `size` at max_model_len 32768 on 16 GiB."""
    m = arm_metrics("default", ppl_rel=rel, skip=skip, sample_nll=nll)
    info = dc_replace(m.info, scales={"k": {str(i): 1.0 for i in layers}, "v": {}, "q": {}}, skip_kind=kind)
    rows = {"32768": dc_replace(m.buckets["64"], ppl_rel=rel)}
    engine = engine_numbers(kv_gib=16, kv_groups={"size_tokens": size, "max_model_len": 32768}) if size else None
    return dc_replace(m, info=info, buckets=rows, engine=engine)


def _paired(a, b, tokens):
    """Brute force of the paired test: (log ppl ratio a / b, 2 standard errors), per-sample NLL sums over tokens."""
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / sum(tokens)
    var = sum((di - ti * mean) ** 2 for di, ti in zip(d, tokens)) * len(d) / (len(d) - 1)
    return mean, 2 * math.sqrt(var) / sum(tokens)


def test_verdict_words_the_measured_sliding_arm_in_memory_terms():
    # the numbers: FP8 +1.20 % at 32K, sliding-window layers skipped +0.61 %; 15 x 512 vs 3 x 32K tokens
    bm = _bytes_model()
    sliding = bm.layers.sliding
    results = {"default": _arm(0.0120),
               "default skip sliding_window": _arm(0.0061, sliding, "sliding_window",
                                                   [i for i in range(18) if i not in sliding])}
    v = report.verdict(reference_metrics(), results, report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    share = (15 * 512) / (15 * 512 + 3 * 32768)     # the sliding layers' share of the bytes at 32K
    assert abs(v.skips_by_memory[0]["saving_given_back"] - share) < 1e-12
    assert ("skip sliding-window layers: ppl loss +1.20 % -> +0.61 % for 7 % of the memory saving at 32K "
            "(emulation); serve: `vllm serve m --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window`"
            in v.text)
    worse = {**results, "default skip sliding_window": _arm(0.0130, sliding, "sliding_window",
                                                            [i for i in range(18) if i not in sliding])}
    v = report.verdict(reference_metrics(), worse, report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    assert "+1.20 % -> +1.30 % for 7 % of the memory saving at 32K (emulation): measured, and it does not help" in v.text
    # nothing measured, nothing claimed
    v = report.verdict(reference_metrics(), {"default": results["default"]}, report.Thresholds(), "bf16", bm)
    assert "ppl loss" not in v.text and "would not help" not in v.text


def test_a_target_that_cannot_skip_says_so_and_gets_no_sliding_arm(gemma3, tmp_path):
    res, src = gemma3
    data = src.parent / "tokens.jsonl"
    out = run_eval(eval_config(src, data, tmp_path / "r", samples=4, passkey_trials=0, target="trtllm"))
    assert not [n for n in out.arms if "sliding_window" in n]
    notes = json.loads((out.out / "report.json").read_text())["notes"]
    assert any(n.startswith("TensorRT-LLM cannot keep sliding-window layers at the model dtype") for n in notes)


def test_the_engine_runs_the_sliding_arm_by_kind_name(gemma3, tmp_path, monkeypatch):
    """The (fake) engine gets skip_layers ["sliding_window"] and resolves it to the same layers the emulation kept
    unquantised: its perplexity equals the emulated one (the fake engine runs the emulation)."""
    import sys
    from pathlib import Path

    from calib.engine import driver
    from calib.engine.driver import EngineSpec

    monkeypatch.setenv(driver.RUNNER_ENV, str(Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")
    res, src = gemma3
    spec = EngineSpec("vllm", Path(sys.executable).parent.parent, top_k=8, continuation_tokens=1)
    out = run_eval(eval_config(src, src.parent / "tokens.jsonl", tmp_path / "r", samples=4, passkey_trials=0,
                               engine=spec))
    arm = out.arms["default skip sliding_window"]
    assert arm.engine.ok, arm.engine
    # the memory table's reference row shows the engine's run of the reference, as every arm's row does
    rows = json.loads((out.out / "report.json").read_text())["memory"]["rows"]
    ref = out.report["reference"]
    assert out.reference.engine.kv_capacity_tokens > 0
    assert rows[ref]["engine_capacity_tokens"] == out.reference.engine.kv_capacity_tokens
    assert rows[ref]["engine_tokens_per_gib"] == out.reference.engine.tokens_per_gib
    assert arm.engine.summary.ppl == pytest.approx(arm.summary.ppl, rel=1e-5)
    assert arm.engine.summary.ppl != pytest.approx(out.arms["default"].engine.summary.ppl, rel=1e-6)


# CPU vLLM 0.32's answer for the tiny Gemma-3-shaped model of tests/engine/test_vllm_hybrid.py (3 sliding layers,
# window 64, 1 global; 1 KV head x 64; bf16; 1 GiB pool; max_model_len 512), arm FP8 with sliding_window skipped
VLLM_032_FP8_SKIP_SLIDING = {
    "size_tokens": 986895, "max_concurrency": 1927.5294117647059, "max_model_len": 512, "num_blocks": 32768,
    "in_flight_tokens": 1024, "groups": [
        {"layers": [i], "spec": "SlidingWindowSpec", "block_size": 128, "page_bytes": 32768, "dtype": "bfloat16",
         "window": 64} for i in range(3)] + [
        {"layers": [3], "spec": "FullAttentionSpec", "block_size": 256, "page_bytes": 32768, "dtype": "uint8",
         "window": None}]}


def test_engine_check_reproduces_vllms_capacity():
    from calib.evaluation.results import ArmInfo

    layers = lk.layer_kinds({"num_hidden_layers": 4, "sliding_window": 64,
                             "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    m = memory.Model(layers, 1, 64, "bfloat16", (512,))
    info = ArmInfo("default", "fp8_e4m3", "tensor", True, None, (0, 1, 2), (), (), {"k": {"3": 1.0}}, "sliding_window")
    c = memory.engine_check(m, info, VLLM_032_FP8_SKIP_SLIDING)
    # by hand: sliding 3 x (cdiv(min(63 + 1024, 512), 128) + 1) x 128 tokens x 256 B + global 512 tokens x 128 B
    per_request = 3 * 640 * 256 + 512 * 128
    assert c == {"engine": 986895, "bytes_model": int(2 ** 30 / per_request * 512), "max_model_len": 512,
                 "problems": []}
    assert c["bytes_model"] == c["engine"]
    # the arm read as FP8 everywhere disagrees with the engine, and says where
    wrong = memory.engine_check(m, ArmInfo("default", "fp8_e4m3", "tensor", True, None, (), (), (),
                                           {"k": {str(i): 1.0 for i in range(4)}}), VLLM_032_FP8_SKIP_SLIDING)
    assert wrong["bytes_model"] is None and wrong["problems"][0] == \
        "layer 0: 256 bytes per token in the engine, 128 in the bytes model"


def test_protocol_checks_the_optional_kv_groups():
    from calib.engine import answer, protocol

    doc = answer.kv_groups(VLLM_032_FP8_SKIP_SLIDING)
    assert doc == VLLM_032_FP8_SKIP_SLIDING
    bad = {**VLLM_032_FP8_SKIP_SLIDING, "groups": [{**VLLM_032_FP8_SKIP_SLIDING["groups"][0], "block_size": -1}]}
    with pytest.raises(protocol.ProtocolError, match=r"kv_groups.groups\[0\].block_size = -1"):
        answer.kv_groups(bad)
    # an engine version that does not keep its capacity or tokens in flight says null; a wrong type is still an error
    unknown = {**VLLM_032_FP8_SKIP_SLIDING, "size_tokens": None, "max_concurrency": None, "in_flight_tokens": None}
    assert answer.kv_groups(unknown) == unknown
    with pytest.raises(protocol.ProtocolError, match=r"kv_groups.in_flight_tokens = '1024'"):
        answer.kv_groups({**VLLM_032_FP8_SKIP_SLIDING, "in_flight_tokens": "1024"})
    with pytest.raises(protocol.ProtocolError, match=r"kv_groups.num_blocks = None"):
        answer.kv_groups({**VLLM_032_FP8_SKIP_SLIDING, "num_blocks": None})


def _gemma3_4b_groups(size_tokens: int) -> dict:
    """GPU vLLM 0.24's groups for Gemma-3-4B's shape in bf16 (29 sliding layers of window 1024 in 6 groups, the last
    of 4 layers; 5 global; 4 KV heads x 256; 16 GiB pool: 52,428 blocks of 16 tokens; max_num_batched_tokens 16384)."""
    glob = [5, 11, 17, 23, 29]
    sliding = [i for i in range(34) if i not in glob]
    return {"size_tokens": size_tokens, "max_concurrency": size_tokens / 32768, "max_model_len": 32768,
            "num_blocks": 52428, "in_flight_tokens": 16384, "groups": [
                {"layers": sliding[j::6], "spec": "SlidingWindowSpec", "block_size": 16, "page_bytes": 65536,
                 "dtype": "bfloat16", "window": 1024} for j in range(6)] + [
                {"layers": glob, "spec": "FullAttentionSpec", "block_size": 16, "page_bytes": 65536,
                 "dtype": "bfloat16", "window": None}]}


def test_memory_table_shows_the_references_engine_run():
    layers = lk.layer_kinds({"num_hidden_layers": 34, "sliding_window": 1024, "sliding_window_pattern": 6})
    m = memory.Model(layers, 4, 256, "bfloat16", (32768,), "m")
    ref = engine_numbers(status="ok", kv_capacity_tokens=838848, kv_gib=16, kv_groups=_gemma3_4b_groups(200181))
    doc = memory.table(m, "bf16", {}, ref)
    row = doc["rows"]["bf16"]
    assert (row["engine_capacity_tokens"], row["engine_tokens_per_gib"]) == (838848, 52428.0)
    # vLLM's capacity for it: 52,428 blocks / (2,048 global + 6 x 1,089 sliding blocks per request) x 32,768; the
    # padded sliding group counts as a full one (a per-layer count, 29 not 30 sliding layers, says 205,394)
    assert row["engine_check"] == {"engine": 200181, "bytes_model": int(52428 / (2048 + 6 * 1089) * 32768),
                                   "max_model_len": 32768, "problems": []}
    assert row["engine_check"]["bytes_model"] == 200181
    md = "\n".join(markdown.memory_lines(doc))
    assert "| bf16 | " in md and "52,428" in md and "200,181 vs 200,181 at 32,768" in md
    # without the reference's engine entry the row has no engine numbers (nothing made up)
    bare = memory.table(m, "bf16", {})["rows"]["bf16"]
    assert bare["engine_capacity_tokens"] is None and "engine_check" not in bare


def test_engine_check_names_a_grouping_other_than_vllms_rule():
    layers = lk.layer_kinds({"num_hidden_layers": 34, "sliding_window": 1024, "sliding_window_pattern": 6})
    m = memory.Model(layers, 4, 256, "bfloat16", (32768,), "m")
    groups = _gemma3_4b_groups(200181)
    merged = {**groups, "groups": [{**groups["groups"][0], "layers": [i for g in groups["groups"][:6]
                                                                      for i in g["layers"]]}, groups["groups"][6]]}
    c = memory.engine_check(m, None, merged)
    assert c["bytes_model"] is None and c["problems"] == [
        "the engine makes 2 KV cache groups of up to 29 layers, vLLM's grouping rule on kvcalib's layer kinds 7 of 5"]


def test_the_verdict_adds_the_engines_own_share_of_the_saving_a_skip_gives_back():
    """vLLM reserves for a sliding-window layer its window plus the tokens in flight, so in its own accounting a
    sliding-window skip gives back far more of FP8's saving than the bytes model's share. With the capacities the
    engine reported (a Gemma-3-4B shape, 16 GiB, max_model_len 32768, 16384 tokens in flight: 200,181 BF16, 400,367
    FP8, 227,303 FP8 with the sliding layers in BF16), the line states both; without them, only the bytes model's."""
    bm = _bytes_model()
    sliding = bm.layers.sliding
    rest = [i for i in range(18) if i not in sliding]
    results = {"default": _arm(0.0120, size=400_367),
               "default skip sliding_window": _arm(0.0061, sliding, "sliding_window", rest, size=227_303)}
    ref = reference_metrics(engine={"kv_gib": 16, "kv_groups": {"size_tokens": 200_181, "max_model_len": 32768}})
    v = report.verdict(ref, results, report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    per_token = {n: 16 * 2 ** 30 / n for n in (200_181, 400_367, 227_303)}
    share = (per_token[227_303] - per_token[400_367]) / (per_token[200_181] - per_token[400_367])
    assert abs(v.skips_by_memory[0]["engine_saving_given_back"] - share) < 1e-12 and round(100 * share) == 76
    assert ("for 7 % of the memory saving at 32K (emulation), 76 % in the engine's own accounting at max_model_len "
            "32,768 (what it reserves per request); serve:" in v.text)
    # the reference's capacity missing: only the bytes model's share
    v = report.verdict(reference_metrics(), results, report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    assert v.skips_by_memory[0]["engine_saving_given_back"] is None and "engine's own accounting" not in v.text


def test_a_skip_within_the_paired_noise_does_not_help_and_gets_no_serve_command():
    """The H100 run of the random-weight hybrid shape at 32K: the sliding-window skip moved perplexity by 0.01 %,
    far inside the noise, and the verdict printed its serve command. Paired by sample against the base arm
    (brute force below), a change within 2 standard errors is said to be within noise and ranked last; a change
    outside them keeps the serve command."""
    bm = _bytes_model()
    sliding = bm.layers.sliding
    rest = [i for i in range(18) if i not in sliding]
    tokens = (1000, 1000, 1000, 1000)

    base_nll = (2000.0, 2100.0, 1900.0, 2050.0)
    noisy = (2004.0, 2092.0, 1906.0, 2047.0)            # lower in sum by 1 nat, scattered by several per sample
    mean, noise = _paired(noisy, base_nll, tokens)
    assert abs(mean) <= noise                           # the brute force says: within noise
    results = {"default": _arm(0.0120, nll=base_nll),
               "default skip sliding_window": _arm(0.0119, sliding, "sliding_window", rest, nll=noisy)}
    v = report.verdict(reference_metrics(sample_tokens=tokens), results,
                       report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    c = v.skips_by_memory[0]
    assert c["helps"] is False and c["ppl_log_ratio_vs_base"] == pytest.approx(mean)
    assert c["noise"] == pytest.approx(noise)
    assert (f"within noise (ppl x{math.exp(mean):.4f} against `default` over every sample, noise "
            f"±{100 * noise:.2g} %), so it does not help") in v.text
    assert "--kv-cache-dtype-skip-layers sliding_window`" not in v.text
    # the same mean change, steady across samples: outside the noise, the serve command stays
    steady = tuple(x - 0.25 for x in base_nll)
    results["default skip sliding_window"] = _arm(0.0119, sliding, "sliding_window", rest, nll=steady)
    v = report.verdict(reference_metrics(sample_tokens=tokens), results,
                       report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    assert v.skips_by_memory[0]["helps"] is True
    assert "serve: `vllm serve m --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window`" in v.text


def test_the_skip_noise_pairs_the_samples_of_the_candidates_bucket():
    """The loss line is read at the longest bucket, so its noise is too: two 8K samples that scatter widely do not
    hide a steady gain on the two 32K samples (brute force: within noise over every sample, outside it over the
    32K bucket's)."""
    bm = _bytes_model()
    sliding = bm.layers.sliding
    rest = [i for i in range(18) if i not in sliding]
    tokens = (8000, 8000, 30000, 30000)                 # samples of 8,001 and 30,001 tokens: buckets 8192 and 32768

    base = (16000.0, 16100.0, 60000.0, 60200.0)
    skip = (16200.0, 15850.0, 59970.0, 60171.0)         # 8K: +200 / -250; 32K: -30 / -29, steady
    every = _paired(skip, base, tokens)
    at_32k = _paired(skip[2:], base[2:], tokens[2:])
    assert abs(every[0]) <= every[1] and abs(at_32k[0]) > at_32k[1]
    results = {"default": _arm(0.0120, nll=base),
               "default skip sliding_window": _arm(0.0061, sliding, "sliding_window", rest, nll=skip)}
    v = report.verdict(reference_metrics(sample_tokens=tokens), results,
                       report.Thresholds(max_ppl_increase=0.02), "bf16", bm)
    c = v.skips_by_memory[0]
    assert c["noise_over"] == "the 2 samples of bucket <= 32768" and c["helps"] is True
    assert c["ppl_log_ratio_vs_base"] == pytest.approx(at_32k[0]) and c["noise"] == pytest.approx(at_32k[1])
    assert "serve: `vllm serve m --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window`" in v.text
