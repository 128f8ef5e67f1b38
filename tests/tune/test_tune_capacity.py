"""`kvcalib tune --engine vllm` chooses by eval's capacity rule (calib/evaluation/capacity.py `by_capacity`; issue 42
item 5): the most KV capacity among candidates within the bar that gain over BF16 for real, BF16 when none does;
without the engine's count, the fewest skipped layers, and tune says capacity was not counted by the engine."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from calib.evaluation import capacity as honest
from calib.evaluation import verdict as report
from calib.evaluation.capacity import CapacityRow, by_capacity
from calib.tune import choose as choose_mod
from calib.tune import output, space
from calib.tune.search import Search
from helpers import arm_metrics, engine_numbers, reference_metrics

LENGTH, REF, LAYERS, REF_BYTES = 64, 20, 8, 2
TH = report.Thresholds(max_kl=0.01)


def _engine_entry(m, requests: int):
    return engine_numbers(status="ok", kv_capacity_tokens=requests * LENGTH, kv_gib=1, summary=m.summary.to_dict(),
                          buckets={b: r.to_dict() for b, r in m.buckets.items()})


def _search(cands: list[tuple[space.Candidate, float]], counts: dict[tuple[int, ...], int | None],
            ref_requests: int | None = REF) -> Search:
    """Candidates with their worst-bucket KL; `counts`: per skip set, the engine's request count at LENGTH, put on
    the first candidate of that skip set (the others unconfirmed), None: the engine did not run that layout."""
    entries = {c.name: arm_metrics("candidate", kl=kl) for c, kl in cands}
    ref = reference_metrics(engine=None if ref_requests is None else
                            {"status": "ok", "kv_capacity_tokens": ref_requests * LENGTH, "kv_gib": 1})
    found = Search([c for c, _ in cands], entries, {c.name: c.name for c, _ in cands}, ref)
    for skip, n in counts.items():
        first = next((c for c, _ in cands if c.skip == skip), None)
        if n is not None and first is not None:
            found.engine[first.name] = _engine_entry(entries[first.name], n)
    return found


def test_fewer_skipped_layers_without_a_real_gain_lose_to_more_with_one():
    """A hybrid-shaped table: FP8 everywhere misses the bar; keeping the one global layer in BF16 (1 skip) leaves the
    engine 21 requests against BF16's 20 (no gain), keeping the sliding-window layers (5 skips) leaves 32 (a gain).
    The old rule (fewest skips) took the 1-skip candidate; the capacity rule takes the 5-skip one. With the 1-skip
    candidate at 26 requests (a real, smaller gain) the 5-skip one still wins on capacity."""
    full = space.Candidate("vllm")
    glob, sliding = full.skipping([7]), full.skipping([0, 1, 2, 3, 4])
    cands = [(full, 0.05), (glob, 0.001), (sliding, 0.004)]
    found = _search(cands, {(): 40, (7,): 21, (0, 1, 2, 3, 4): 32})
    table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
    choice = choose_mod.decide(found, table)
    assert choice.rule == choose_mod.ENGINE_COUNTED and choice.row["name"] == sliding.name
    assert choice.decision.labels[glob.name] == honest.NO_CAPACITY_GAIN
    assert [r.name for r in choice.rows] == ["reference", glob.name, sliding.name]      # within the bar only
    # a smaller real gain with fewer skips: still the most capacity wins
    found = _search(cands, {(): 40, (7,): 26, (0, 1, 2, 3, 4): 32})
    table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
    assert choose_mod.decide(found, table).row["name"] == sliding.name
    assert choose_mod._settle(found, choose_mod._fewest([r for r in table if not r["failures"]]))["name"] == \
        glob.name                                                                 # what the old rule took
    # no engine count of the reference: the old rule, and tune says capacity was not counted by the engine
    found.ref = reference_metrics()
    table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
    choice = choose_mod.decide(found, table)
    assert choice.rule == choose_mod.NOT_COUNTED and choice.row["name"] == glob.name and choice.decision is None
    said = choice.to_dict()
    assert said["counted_by_engine"] is False and "not counted by the engine" in said["text"]
    assert "kvcalib validate" in said["text"] and "decision" not in said


def test_one_layout_counts_once_and_the_engine_count_of_a_layout_is_shared():
    """Candidates that store the cache alike (same KV dtype and skipped layers) hold the same pool: the engine's
    count for one (or for the default scale 1.0) is the count for all, said as `counted_on`; within a layout tune's
    own tie rule picks the candidate by_capacity ranks (noise ties go to the recipe every backend applies)."""
    tensor, head = space.Candidate("vllm"), space.Candidate("vllm", granularity="head", observer="mse")
    cands = [(tensor, 0.0011), (head, 0.0010)]         # head: lower KL, within noise (no per-sample numbers)
    found = _search(cands, {(): 40})
    table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
    caps = {r["name"]: r["capacity"] for r in table}
    assert caps[head.name]["source"] == "engine" and caps[head.name]["counted_on"] == tensor.name
    assert caps[head.name]["requests"] == caps[tensor.name]["requests"] == 40
    choice = choose_mod.decide(found, table)
    assert choice.row["name"] == tensor.name and [r.name for r in choice.rows] == ["reference", tensor.name]
    assert by_capacity(choice.rows, LENGTH).recommended == tensor.name
    # the default scale 1.0 counted by the engine: every FP8 candidate without skips reads its count
    found = _search(cands, {})
    base = arm_metrics("default", kl=0.02)
    found.entries["default"] = replace(base, engine=_engine_entry(base, 40))
    table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
    assert {r["capacity"]["counted_on"] for r in table} == {"default"}


def _brute_rows(cands, counts, found, table):
    """The rows written out from the table, independently of tune: the reference, then every candidate within the
    bar in the table's order, its layout's engine count where the engine ran the layout, else None, and the bytes
    model's 1 / (1 - memory saved)."""
    kl = dict((c.name, k) for c, k in cands)
    rows = [CapacityRow("reference", True, 0.0, REF, 1.0, reference=True)]
    for c, _ in cands:
        if kl[c.name] > TH.max_kl:
            continue
        saved = space.memory_saved(c, LAYERS, REF_BYTES)
        rows.append(CapacityRow(c.name, True, kl[c.name], counts.get(c.skip), 1 / (1 - saved)))
    return rows


def test_tunes_pick_is_by_capacitys_on_the_same_rows_brute_force(monkeypatch):
    """Random tables (seeded) of up to six candidates over three layouts (no skip, one layer, five layers), engine
    counts from BF16's to twice it or not run, KLs within and beyond the bar, exact KL ties included; no noise ties
    (every pair measurably different), so tune's within-layout step picks the lowest KL, the earlier on a tie.
    tune's pick (None: keep BF16) equals by_capacity's recommendation on the rows written out independently."""
    monkeypatch.setattr(choose_mod.score, "compare", lambda *a: {"measurable": True})
    shapes = [space.Candidate("vllm", granularity=g, observer=o, q_scale=q) for g in ("tensor", "head")
              for o in ("absmax", "mse") for q in (False, True)]
    skips = [(), (7,), (0, 1, 2, 3, 4)]
    rng = random.Random(42)
    picks = {}
    for t in range(600):
        chosen_shapes = rng.sample(shapes, rng.randint(1, 4))
        cands = []
        for s in chosen_shapes:
            for skip in rng.sample(skips, rng.randint(1, 2)):
                cands.append((s.skipping(skip) if skip else s, rng.choice((0.001, 0.002, 0.002, 0.05))))
        cands = cands[:6]
        counts = {skip: rng.choice((None, REF, REF + 1, 21, 22, 26, 30, 40)) for skip in skips}
        found = _search(cands, counts)
        present = {c.skip for c, _ in cands}
        counts = {k: v for k, v in counts.items() if k in present}
        table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
        pick = choose_mod.decide(found, table).row
        want = by_capacity(_brute_rows(cands, counts, found, table), LENGTH).recommended
        got = "reference" if pick is None else pick["name"]
        assert got == want, (cands, counts)
        picks[got == "reference"] = picks.get(got == "reference", 0) + 1
    assert picks.get(True, 0) > 20 and picks.get(False, 0) > 200          # both outcomes exercised


def test_tune_md_and_json_say_which_rule_chose_and_that_speed_was_not_measured():
    full, sliding = space.Candidate("vllm"), space.Candidate("vllm").skipping([0, 1, 2, 3, 4])
    found = _search([(full, 0.001), (sliding, 0.0005)], {(): 40, (0, 1, 2, 3, 4): 30})
    table = choose_mod.rows(found, TH, LAYERS, REF_BYTES, "default")
    choice = choose_mod.decide(found, table)
    said = choice.to_dict()
    assert said["rule"] == "capacity (eval's rule)" and said["counted_by_engine"] is True
    assert said["decision"]["recommended"] == full.name and said["decision"]["rule"] == honest.CAPACITY_RULE
    assert "eval's capacity rule" in said["text"] and "Speed is not measured" in said["text"]
    assert "`kvcalib validate`" in said["speed"]
    labels = {a["arm"]: a["label"] for a in said["decision"]["arms"]}
    assert labels == {"reference": "reference", full.name: "recommended", sliding.name: "less capacity"}


@pytest.mark.slow        # one engine subprocess per start (each imports torch and transformers): ~1-2 min
def test_tune_with_the_fake_engine_chooses_by_capacity(tmp_path, monkeypatch):
    """A hybrid model (23 sliding-window layers, one global; tests/fake_vllm_runner.py holds a skipped layer at the
    model dtype): tune confirms its short list in the engine; the sliding-window skip holds about the reference's
    requests (no capacity gain) and is never chosen; tune's choice is by_capacity's on the rows it records, and
    tune.json / tune.md say the capacity rule chose, on the engine's count, and that speed was not measured."""
    from calib.engine import driver
    from calib.engine.driver import EngineSpec
    from calib.tune import run
    from helpers import boosted
    from tiny import tiny_causal_lm
    from helpers import tune_config as _config
    from helpers import tune_data as _data

    monkeypatch.setenv(driver.RUNNER_ENV, str(Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")
    n = 24
    model = boosted(tiny_causal_lm("gemma3", num_hidden_layers=n, sliding_window=8,
                                   layer_types=["sliding_attention"] * (n - 1) + ["full_attention"]))
    model.save_pretrained(tmp_path / "g")
    spec = EngineSpec("vllm", Path(sys.executable).parent.parent, top_k=8, continuation_tokens=1)
    res = run.run(_config(tmp_path / "g", _data(tmp_path), tmp_path / "out", max_skip=0, observers=("absmax",),
                          headrooms=(1.0,), engine=spec, confirm=5))
    doc = json.loads((tmp_path / "out" / output.JSON).read_text())
    cap = doc["capacity"]
    assert cap["rule"] == choose_mod.ENGINE_COUNTED and cap["counted_by_engine"] is True
    skip = next(r for r in doc["candidates"] if r["skip"])
    assert len(skip["skip"]) == n - 1 and skip["capacity"]["gain"] is False
    assert skip["capacity"]["source"] == "engine" and skip["capacity"]["vs_reference"] < 1.05
    assert res.chosen is None or res.chosen["name"] != skip["name"]
    # the rows written out from tune.json: BF16's engine count, then the candidates tune ranked (one per KV layout
    # within the bar: its tie rule settles the rest) with the engine's count (it confirmed every candidate)
    within = [r for r in doc["candidates"] if r["scored"] and not r["failures"]]
    ranked = [a["arm"] for a in cap["decision"]["arms"] if a["arm"] != "reference"]
    assert sorted(len(next(r for r in within if r["name"] == a)["skip"]) for a in ranked) == \
        sorted({len(r["skip"]) for r in within})
    assert all(r["capacity"]["source"] == "engine" for r in doc["candidates"] if r["scored"])
    rows = [CapacityRow("reference", True, 0.0, skip["capacity"]["reference_requests"], 1.0, reference=True)]
    rows += [CapacityRow(r["name"], True, r["summary"]["max_bucket_kl"], r["capacity"]["requests"],
                         1 / (1 - r["memory_saved"])) for r in within if r["name"] in ranked]
    want = by_capacity(rows, cap["decision"]["length"]).recommended
    assert (res.chosen["name"] if res.chosen else "reference") == want == cap["decision"]["recommended"]
    md = (tmp_path / "out" / output.MD).read_text()
    assert "eval's capacity rule" in md and "Speed is not measured" in md and "kvcalib validate" in md
