"""eval's recommendation when speed was not measured: among arms within the quality bar, the most KV capacity (the
engine's own count, else the bytes model), never an arm whose gain over BF16 is within noise of zero
(calib/evaluation/capacity.py `by_capacity`; issue 42 item 5). The rule against brute force on synthetic arm tables, the
verdict built on it, and tune's choice with an engine."""

from __future__ import annotations

import itertools
from dataclasses import replace as dc_replace

import pytest

from calib.evaluation import capacity as honest
from calib.evaluation import memory
from calib.evaluation import verdict as report
from calib.evaluation.capacity import CapacityRow, by_capacity
from calib.model import layer_kinds as lk
from helpers import arm_metrics, engine_numbers, reference_metrics

REF = 20                                  # the reference's requests at the rule's length in the synthetic tables


def _gains_brute(requests: int, ref: int) -> bool:
    """A real gain, written out: more than one request and more than 5 % above the reference."""
    return requests - ref > 1 and requests > ref * 1.05


def _dominates_brute(b: CapacityRow, a: CapacityRow, rows: list[CapacityRow]) -> bool:
    """b as good or better on quality and capacity, and better on one, or equal on both and listed first (the
    reference stands on a tie)."""
    if b is a or not (b.within_bar or b.reference) or b.quality > a.quality or b.requests < a.requests:
        return False
    return b.quality < a.quality or b.requests > a.requests or b.reference or rows.index(b) < rows.index(a)


def test_the_rule_against_brute_force_on_every_small_table():
    """Every table of up to three arms over a grid of capacities (BF16's, +1 request, +5 %, +10 %, twice), two
    quality levels and pass / fail: the recommendation is an arm within the bar with a real gain, the most capacity
    among those (ties: the better quality, then the earlier arm), never one another beats or equals on quality and
    capacity together; BF16 exactly when no arm within the bar gains; every label as the brute force says."""
    caps = (REF, REF + 1, 21, 22, 40)            # 21: one request (5 %); 22: +10 %, two requests; 40: twice
    quals = (0.1, 0.2)
    cells = list(itertools.product(caps, quals, (True, False)))
    tables = 0
    for n in (1, 2, 3):
        for combo in itertools.product(cells, repeat=n):
            arms = [CapacityRow(f"a{j}", ok, q, c, None) for j, (c, q, ok) in enumerate(combo)]
            rows = [CapacityRow("bf16", True, 0.0, REF, None, reference=True), *arms]
            d = by_capacity(rows, 32768)
            tables += 1
            gainers = [a for a in arms if a.within_bar and _gains_brute(a.requests, REF)]
            if not gainers:
                assert d.recommended == "bf16", combo
            else:
                best = max(a.requests for a in gainers)
                top = [a for a in gainers if a.requests == best]
                q = min(a.quality for a in top)
                assert d.recommended == next(a.name for a in top if a.quality == q), combo
                win = next(a for a in arms if a.name == d.recommended)
                assert not any(_dominates_brute(b, win, rows) for b in rows), combo
            for a in arms:
                label = d.labels[a.name]
                if not a.within_bar:
                    assert label == honest.QUALITY
                elif not _gains_brute(a.requests, REF):
                    assert label == honest.NO_CAPACITY_GAIN and d.recommended != a.name
                elif a.name != d.recommended:
                    assert label in (honest.DOMINATED, honest.LESS_CAPACITY)
                    dominated = any(_dominates_brute(b, a, rows) for b in rows)
                    assert (label == honest.DOMINATED) == dominated, combo
                assert d.ratios[a.name] == pytest.approx(a.requests / REF)
            assert d.labels["bf16"] in (honest.REFERENCE, honest.RECOMMENDED)
    assert tables == 20 + 20 ** 2 + 20 ** 3


def test_the_winner_does_not_depend_on_the_order_except_among_exact_ties():
    rows = [CapacityRow("a", True, 0.2, 40, None), CapacityRow("b", True, 0.1, 40, None),
            CapacityRow("c", True, 0.05, 30, None), CapacityRow("skip", True, 0.01, 21, None)]
    ref = CapacityRow("bf16", True, 0.0, REF, None, reference=True)
    for perm in itertools.permutations(rows):
        d = by_capacity([ref, *perm], 4096)
        assert d.recommended == "b" and d.labels["a"] == honest.DOMINATED and d.labels["c"] == honest.LESS_CAPACITY
        assert d.labels["skip"] == honest.NO_CAPACITY_GAIN
    tie = [CapacityRow("x", True, 0.1, 40, None), CapacityRow("y", True, 0.1, 40, None)]
    assert by_capacity([ref, *tie], 4096).recommended == "x"
    assert by_capacity([ref, *reversed(tie)], 4096).recommended == "y"
    assert by_capacity([ref, *tie], 4096).labels["y"] == honest.DOMINATED


def test_a_skip_with_bf16s_capacity_is_no_gain_and_twice_the_capacity_is():
    ref = CapacityRow("bf16", True, 0.0, 24, 10.0, reference=True)
    skip = CapacityRow("default skip sliding_window", True, 0.0008, 25, 10.9)     # +1 request (+4 %) in the engine
    d = by_capacity([ref, skip], 32000)
    assert d.recommended == "bf16" and d.labels[skip.name] == honest.NO_CAPACITY_GAIN
    assert d.sources[skip.name] == honest.ENGINE          # the engine's count decides, not the model's +9 %
    double = CapacityRow("default", True, 0.004, 48, 20.0)
    d = by_capacity([ref, skip, double], 32000)
    assert d.recommended == "default" and d.ratios["default"] == 2.0
    # +2 requests but 4 %: within the relative floor; +3 of 20 (15 %): a gain
    assert not honest.capacity_gain(CapacityRow("s", True, 0, 52, None), CapacityRow("r", True, 0, 50, None, True))
    assert honest.capacity_gain(CapacityRow("s", True, 0, 23, None), CapacityRow("r", True, 0, 20, None, True))
    # no engine count: the bytes model's ratio alone, no request rule
    assert honest.capacity_gain(CapacityRow("s", True, 0, None, 1.06), CapacityRow("r", True, 0, None, 1.0, True))
    assert not honest.capacity_gain(CapacityRow("s", True, 0, None, 1.04), CapacityRow("r", True, 0, None, 1.0, True))
    # nothing known: nothing ranked
    d = by_capacity([CapacityRow("bf16", True, 0.0, None, None, True), CapacityRow("a", True, 0.1, None, None)], 64)
    assert d.recommended is None and d.labels["a"] == honest.NOT_MEASURED


def test_engine_requests_read_the_groups_where_reported_else_the_pool():
    assert honest.engine_requests(engine_numbers(status="ok", kv_capacity_tokens=100_000), 32768) == 3
    assert honest.engine_requests(engine_numbers(status="not_run", kv_capacity_tokens=100_000), 32768) is None
    assert honest.engine_requests(None, 32768) is None
    groups = {"num_blocks": 1000, "in_flight_tokens": 2048, "max_model_len": 32768, "size_tokens": 1,
              "groups": [{"layers": [0], "spec": "FullAttentionSpec", "block_size": 16, "page_bytes": 1,
                          "window": None}]}
    assert honest.engine_requests(engine_numbers(status="ok", kv_capacity_tokens=10 ** 9, kv_groups=groups), 1600) == \
        lk.engine_requests_fit(groups, 1600) == 10


# ------------------------------------------------------------------------------------------- the verdict


def _hybrid_model():
    """The issue's hybrid shape: 18 layers, every 6th global, window 512; 1 KV head x 256, bf16."""
    layers = lk.layer_kinds({"num_hidden_layers": 18, "sliding_window": 512, "sliding_window_pattern": 6})
    return memory.Model(layers, 1, 256, "bfloat16", (8192, 32768), "m")


def _arm(rel, skip=(), kind=None, layers=range(18), cap=None, kl=0.001):
    """An FP8 arm of the 18-layer shape: ppl loss `rel`, scales on `layers`, the engine's pool `cap` tokens."""
    m = arm_metrics("default", ppl_rel=rel, skip=skip, kl=kl,
                    layers={str(i): {"attn_rel_error": 0.01} for i in range(24)})
    info = dc_replace(m.info, scales={"k": {str(i): 1.0 for i in layers}, "v": {}, "q": {}}, skip_kind=kind)
    rows = {"32768": dc_replace(m.buckets["64"], ppl_rel=rel, kl=kl)}
    engine = None
    if cap is not None:
        summary = {"ppl": 10.0 * (1 + rel), "ppl_rel": rel, "kl": kl, "max_bucket_kl": kl, "top1": 0.99,
                   "samples": 2, "tokens": 126, "ppl_ref": 10.0, "ppl_delta": 10.0 * rel}
        engine = engine_numbers(status="ok", version="0.24", kv_capacity_tokens=cap, kv_gib=8, summary=summary,
                                buckets={"32768": {**summary}})
    return dc_replace(m, info=info, buckets=rows, engine=engine)


def _results(bm, default_rel, skip_rel, caps=(None, None), skip_kl=0.0005):
    sliding = bm.layers.sliding
    rest = [i for i in range(18) if i not in sliding]
    return {"default": _arm(default_rel, cap=caps[0]),
            "default skip sliding_window": _arm(skip_rel, sliding, "sliding_window", rest, cap=caps[1], kl=skip_kl)}


def test_the_verdict_keeps_bf16_when_the_only_arm_within_the_bar_is_a_skip_with_bf16s_capacity():
    """FP8 everywhere misses the bar, the sliding-window skip passes, and the engine counts about BF16's capacity
    for it (one request more at 32K): the verdict keeps BF16, says the skip has no capacity gain and that speed was
    not measured. With twice the capacity, FP8 within the bar is recommended over the skip."""
    bm = _hybrid_model()
    ref = reference_metrics(engine={"status": "ok", "kv_capacity_tokens": 24 * 32768, "kv_gib": 8})
    ref = dc_replace(ref, buckets={"32768": ref.buckets["64"]})
    th = report.Thresholds(max_ppl_increase=0.01, max_kl=0.01)
    v = report.verdict(ref, _results(bm, 0.0117, 0.0008, (48 * 32768, 25 * 32768)), th, "bf16", bm)
    assert v.action == "keep_reference" and v.arm is None and v.flag is None
    assert "no capacity gain" in v.text and "Speed was not measured" in v.text and "kvcalib validate" in v.text
    assert "--kv-cache-dtype-skip-layers" not in v.text.split("Speed was not measured")[0]
    cap = v.to_dict()["capacity"]
    labels = {a["arm"]: a["label"] for a in cap["arms"]}
    assert labels == {"bf16": "recommended", "default": "fails the quality bar",
                      "default skip sliding_window": "no capacity gain"}
    assert v.skips_by_memory[0]["capacity_gain"] is False and "so no serve command" in v.text
    # FP8 everywhere within the bar too: twice the capacity, recommended
    v = report.verdict(ref, _results(bm, 0.0090, 0.0008, (48 * 32768, 25 * 32768)), th, "bf16", bm)
    assert v.action == "ship" and v.arm == "default"
    assert "`default`: 2.00x the reference's capacity (engine)" in v.text
    assert "no capacity gain: `default skip sliding_window` (1.04x)" in v.text
    assert "Speed was not measured" in v.text


def test_without_the_engine_the_bytes_model_ranks_and_the_verdict_says_it_is_a_model():
    bm = _hybrid_model()
    ref = reference_metrics()
    th = report.Thresholds(max_ppl_increase=0.01, max_kl=0.01)
    v = report.verdict(ref, _results(bm, 0.0117, 0.0008), th, "bf16", bm)
    # the bytes model: the sliding layers hold 512 of 32K, so the skip keeps most of FP8's saving: a gain; unconfirmed
    assert v.action == "skip_unconfirmed"
    v = report.verdict(ref, _results(bm, 0.0090, 0.0008), th, "bf16", bm)
    assert v.action == "ship" and v.arm == "default"
    assert "kvcalib's bytes model, not the engine's count" in v.text and "Speed was not measured" in v.text


def test_an_unconfirmed_skip_without_capacity_gain_is_not_suggested():
    """A model whose windows are as long as the longest bucket: keeping the sliding layers in BF16 keeps all but the
    global layer's saving (the bytes model says 1.02x): the verdict keeps BF16 instead of asking to measure it."""
    layers = lk.layer_kinds({"num_hidden_layers": 24, "sliding_window": 32768, "sliding_window_pattern": 24})
    bm = memory.Model(layers, 1, 256, "bfloat16", (32768,), "m")
    sliding = layers.sliding
    rest = [i for i in range(24) if i not in sliding]
    results = {"default": dc_replace(_arm(0.0117), info=dc_replace(_arm(0.0117).info, scales={
        "k": {str(i): 1.0 for i in range(24)}, "v": {}, "q": {}})),
        "default skip sliding_window": _arm(0.0008, sliding, "sliding_window", rest)}
    v = report.verdict(reference_metrics(), results, report.Thresholds(max_ppl_increase=0.01), "bf16", bm)
    assert v.action == "keep_reference" and "no capacity gain over BF16 (1.02x" in v.text
    assert "measure it in the engine" not in v.text


# ------------------------------------------------------------------------------------------- end to end


def test_eval_with_the_engine_keeps_bf16_over_a_skip_with_its_capacity(tmp_path, monkeypatch):
    """A hybrid model of 23 sliding-window layers and one global (the fake engine, tests/fake_vllm_runner.py, holds
    a skipped layer at the model dtype): FP8 everywhere misses a tight KL bar, the sliding-window skip passes and the
    engine confirms it, but it holds 1.03x the reference's requests, so the verdict keeps the reference, says the
    skip has no capacity gain and that speed was not measured. With the default bar FP8 everywhere (4x the fp32
    reference's capacity) is recommended and the skip still named as no gain."""
    import json
    import sys
    from pathlib import Path

    from calib.engine import driver
    from calib.engine.driver import EngineSpec
    from calib.evaluation.run import run_eval
    from helpers import boosted, eval_config, save_model_and_data
    from tiny import tiny_causal_lm

    monkeypatch.setenv(driver.RUNNER_ENV, str(Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")
    n = 24
    model = boosted(tiny_causal_lm("gemma3", num_hidden_layers=n, sliding_window=8, scale_k=30.0,
                                   layer_types=["sliding_attention"] * (n - 1) + ["full_attention"]))
    src, data = save_model_and_data(tmp_path, model, "gemma3")
    spec = EngineSpec("vllm", Path(sys.executable).parent.parent, top_k=8, continuation_tokens=1)
    th = report.Thresholds(max_kl=1e-4)
    res = run_eval(eval_config(src, data, tmp_path / "r", samples=4, passkey_trials=0, engine=spec, plots=False,
                               thresholds=th))
    skip = "default skip sliding_window"
    assert res.arms[skip].engine.ok and res.arms["default"].engine.ok
    v = res.verdict
    assert report.failures(res.arms["default"], res.reference, th) and not report.failures(res.arms[skip],
                                                                                            res.reference, th)
    assert v.action == "keep_reference" and v.arm is None and v.flag is None, v.text
    assert "no capacity gain" in v.text and "Speed was not measured" in v.text and "`kvcalib validate`" in v.text
    assert not v.text.startswith("Ship") and "serve with `--kv-cache-dtype-skip-layers" not in v.text
    doc = json.loads((res.out / "report.json").read_text())
    labels = {a["arm"]: (a["label"], a["source"]) for a in doc["verdict"]["capacity"]["arms"]}
    assert labels[skip] == ("no capacity gain", "engine") and labels[res.report["reference"]][0] == "recommended"
    assert doc["verdict"]["capacity"]["length"] == 64
    assert "Speed was not measured" in (res.out / "report.md").read_text()
    # the default bar: FP8 everywhere within it, 4x the fp32 reference's requests
    v = report.verdict(res.reference, res.arms, report.Thresholds(), res.report["reference"])
    assert v.action == "ship" and v.arm == "default"
    assert "`default`: 4.00x the reference's capacity (engine)" in v.text
    assert f"no capacity gain: `{skip}` (1.03x)" in v.text and "Speed was not measured" in v.text


# ------------------------------------------------------------------------------------------- tune with an engine


def _engine_entry(m, cap):
    return engine_numbers(status="ok", kv_capacity_tokens=cap, kv_gib=1, summary=m.summary.to_dict(),
                          buckets={b: r.to_dict() for b, r in m.buckets.items()})


def test_tune_with_an_engine_does_not_choose_a_candidate_without_capacity_gain():
    """The only candidate within the bar keeps two of three layers in BF16; the engine counts 25 requests of 64
    tokens against the reference's 24: no capacity gain, so tune keeps BF16 and its headline says why. Without the
    engine's count (the bytes model: 1.2x) it is chosen, as before."""
    from calib.tune import choose as choose_mod
    from calib.tune import output, space
    from calib.tune.search import Search

    full, skip = space.Candidate("vllm"), space.Candidate("vllm", skip=(0, 1))
    entries = {full.name: arm_metrics("candidate", kl=0.05), skip.name: arm_metrics("candidate", kl=0.001)}
    ref = reference_metrics(engine={"status": "ok", "kv_capacity_tokens": 24 * 64, "kv_gib": 1})
    found = Search([full, skip], entries, {c.name: c.name for c in (full, skip)}, ref)
    found.engine = {full.name: _engine_entry(entries[full.name], 48 * 64),
                    skip.name: _engine_entry(entries[skip.name], 25 * 64)}
    th = report.Thresholds()
    table = choose_mod.rows(found, th, 3, 2, "default")
    caps = {r["name"]: r["capacity"] for r in table}
    assert caps[skip.name] == {"length": 64, "requests": 25, "reference_requests": 24, "vs_reference": 25 / 24,
                               "source": "engine", "gain": False, "counted_on": skip.name}
    assert caps[full.name]["gain"] is True
    assert choose_mod.decide(found, table).row is None
    doc = {"choice": {"candidate": None}, "candidates": table, "thresholds": th.to_dict()}
    assert "no capacity gain" in output.headline(doc) and "speed was not measured" in output.headline(doc)
    # no engine count of the reference: the old rule (fewest skips within the bar), the bytes model not consulted
    found.ref = reference_metrics()
    table = choose_mod.rows(found, th, 3, 2, "default")
    assert "capacity" not in table[0] and choose_mod.decide(found, table).row["name"] == skip.name
    # the engine counts twice the reference's requests for the skip: a gain, chosen, and the headline says so
    found.ref = ref
    found.engine[skip.name] = _engine_entry(entries[skip.name], 48 * 64)
    table = choose_mod.rows(found, th, 3, 2, "default")
    chosen = choose_mod.decide(found, table).row
    assert chosen["name"] == skip.name
    head = output.headline({"choice": {"candidate": skip.name}, "candidates": table, "thresholds": th.to_dict()})
    assert "2.00x BF16's KV capacity at 64 tokens (engine); speed was not measured" in head
