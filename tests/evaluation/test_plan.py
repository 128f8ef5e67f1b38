"""The time plan: the cost model, the order in which a budget drops parts, and the plan in a real run (the probe's
rates monkeypatched: nothing here depends on how fast this machine is)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from calib.evaluation import plan
from calib.evaluation import run as run_mod
from calib.evaluation.plan import Cost, Parts, Rates, Work, estimate, fit
from calib.progress import duration
from tiny import random_sequences, tiny_causal_lm, tiny_config

COST = Cost(linear=100.0, quadratic=1.0)
RATES = Rates(ref=1e-6, arm=2e-6, engine_start=45.0, engine_tokens_per_s=1e4, probed_at=512)
DEPTHS = plan.DEPTH_STEPS[0]
WORK = Work(samples=tuple((b - 10, b) for b in (512, 2048, 8192) for _ in range(4)),
            prompts=tuple((b - 20, b, d) for b in (512, 2048, 8192) for d in DEPTHS), arms=3, engine=True)
FULL = Parts(None, DEPTHS, 3, True)
ORDER = ["passkey depths 5 -> 3", "passkey depths 3 -> 1", "skip trials (up to 3)",
         "emulated bucket 8192 (measured in the engine only)", "emulated bucket 2048 (measured in the engine only)",
         "the engine's passkey prompts"]


def _total(parts: Parts) -> float:
    return sum(s for _, s in estimate(WORK, parts, COST, RATES))


def test_work_grows_with_the_square_of_the_length():
    assert COST.work(1000) == 1000 * (100 + 1000) and COST.work(2000) / COST.work(1000) == pytest.approx(2 * 2100 / 1100)
    c = Cost.of(tiny_config("llama"), 10_000)
    assert (c.linear, c.quadratic) == (20_000.0, 2.0 * 3 * 4 * 16)


def _scoring(work: Work, rates: Rates = RATES) -> float:
    """One engine arm's scoring, written out: the held-out samples (prompt log-probs) and the passkey prompts
    (generation) each at their per-token overhead or 1.5x the reference pass, whichever is longer."""
    samples = sum(n for n, _ in work.samples)
    prompts = sum(n + plan.MAX_NEW_TOKENS for n, _, _ in work.prompts)
    ref_samples = sum(COST.work(n) for n, _ in work.samples) * rates.ref
    ref_prompts = sum(COST.work(n) + COST.decode(n) for n, _, _ in work.prompts) * rates.ref
    prompt_rate = rates.engine_prompt_tokens_per_s or rates.engine_tokens_per_s
    return (max(samples / rates.engine_tokens_per_s, 1.5 * ref_samples)
            + max(prompts / prompt_rate, 1.5 * ref_prompts))


def test_phases_add_up_from_the_rates():
    phases = dict(estimate(WORK, FULL, COST, RATES))
    per_pass = sum(COST.work(n) for n, _ in WORK.samples)
    assert phases["emulation: reference + 3 arm(s) on 12 samples"] == pytest.approx(per_pass * (1e-6 + 3 * 2e-6))
    assert phases["engine: 4 arms on 4 start(s)"] == pytest.approx(4 * (45 + _scoring(WORK)))


def test_engine_scoring_is_overhead_bound_on_a_small_model_and_compute_bound_on_a_large_one():
    from dataclasses import replace

    fast = replace(RATES, ref=1e-12)                  # a tiny model: the per-token overhead decides
    tokens = sum(n for n, _ in WORK.samples) + sum(n + plan.MAX_NEW_TOKENS for n, _, _ in WORK.prompts)
    assert dict(estimate(WORK, FULL, COST, fast))["engine: 4 arms on 4 start(s)"] == pytest.approx(
        4 * (45 + tokens / 1e4))
    assert _scoring(WORK) > tokens / 1e4              # RATES' reference pass is the slower one: compute decides


def test_passkey_prompts_cost_their_prefill_and_each_decode_step_at_the_measured_latency():
    """Seven decode steps per prompt after its prefill (8 generated tokens), each the probe's measured latency or
    the step's own work at the rate, whichever is longer: written out per prompt."""
    rates = replace(RATES, step_ref=0.05, step_arm=0.125)
    want = 0.0
    for n, _, _ in WORK.prompts:
        step_work = 100.0 + 2 * 1.0 * n                      # one token against n keys: linear + 2 x quadratic x n
        want += n * (100.0 + n) * 1e-6 + 7 * max(0.05, step_work * 1e-6)
        want += 3 * (n * (100.0 + n) * 2e-6 + 7 * max(0.125, step_work * 2e-6))
    assert dict(estimate(WORK, FULL, COST, rates))["emulation passkey: 15 prompts x 4"] == pytest.approx(want)
    assert COST.batch([8000], 1e-6, 0.0) == pytest.approx(8000 * 8100 * 1e-6 + 7 * 16100 * 1e-6)   # FLOPs decide
    assert COST.batch([10], 1e-6, 0.5) == pytest.approx(10 * 110 * 1e-6 + 7 * 0.5)                # latency decides


def test_passkey_prompts_decoded_together_pay_the_decode_latency_once_per_batch():
    """With a batch size, a bucket's prompts are decoded together (at most that many, never across buckets): the
    prefills are the same work, the seven decode steps are paid once per batch at the measured latency or the
    batch's work at the rate, whichever is longer; written out per batch."""
    rates = replace(RATES, step_ref=0.05, step_arm=0.125)
    w = replace(WORK, passkey_batch=2)
    assert plan.prompt_batches([(n, b) for n, b, _ in w.prompts], 2) == [
        [b - 20] * k for b in (512, 2048, 8192) for k in (2, 2, 1)]
    want = 0.0
    for b in (512, 2048, 8192):
        n = b - 20
        for k in (2, 2, 1):
            step_work = k * (100.0 + 2 * 1.0 * n)
            want += k * n * (100.0 + n) * 1e-6 + 7 * max(0.05, step_work * 1e-6)
            want += 3 * (k * n * (100.0 + n) * 2e-6 + 7 * max(0.125, step_work * 2e-6))
    got = dict(estimate(w, FULL, COST, rates))["emulation passkey: 15 prompts x 4"]
    assert got == pytest.approx(want)
    assert got < dict(estimate(WORK, FULL, COST, rates))["emulation passkey: 15 prompts x 4"]
    assert COST.batch([8000, 8000], 1e-6, 0.0) == pytest.approx(2 * COST.batch([8000], 1e-6, 0.0))   # FLOPs decide
    assert COST.batch([10, 10], 1e-6, 0.5) == pytest.approx(2 * 10 * 110 * 1e-6 + 7 * 0.5)            # latency: once


def test_a_prefill_pays_the_lm_head_at_its_last_position_only():
    """A measuring pass reads logits at every position, a generation's prefill at the last one: the head's share
    of the linear term (2 x vocab x hidden, from the config) comes off every other position."""
    c = Cost(linear=100.0, quadratic=1.0, head=40.0)
    assert c.prefill(10) == pytest.approx(10 * (100 + 10) - 9 * 40) and c.prefill(1) == c.work(1)
    assert c.batch([10], 1e-3, 0.0) == pytest.approx((10 * 110 - 9 * 40) * 1e-3 + 7 * (100 + 2 * 10) * 1e-3)
    cfg = tiny_config("llama")
    assert Cost.of(cfg, 10_000_000).head == 2.0 * cfg.vocab_size * cfg.hidden_size


def test_the_engines_passkey_prompts_run_at_their_own_token_rate():
    """Batched generation without log-probs runs far faster per token than prompt log-prob scoring: each part at
    its own rate (a tiny model: the per-token overhead decides both)."""
    rates = replace(RATES, ref=1e-12, engine_prompt_tokens_per_s=1e5)
    samples = sum(n for n, _ in WORK.samples)
    prompts = sum(n + plan.MAX_NEW_TOKENS for n, _, _ in WORK.prompts)
    assert dict(estimate(WORK, FULL, COST, rates))["engine: 4 arms on 4 start(s)"] == pytest.approx(
        4 * (45 + samples / 1e4 + prompts / 1e5))
    no_pk = dict(estimate(WORK, replace(FULL, engine_passkey=False), COST, rates))
    assert no_pk["engine: 4 arms on 4 start(s)"] == pytest.approx(4 * (45 + samples / 1e4))


def test_the_probe_times_a_decode_step_as_the_passkey_phase_runs_it(monkeypatch):
    """decode_step: an untimed run, then (8 tokens - 1 token) / 7 under the arm's hook; a fake clock makes it exact."""
    import contextlib
    from types import SimpleNamespace

    now, calls, applied = [0.0], [], []

    def greedy(lm, ids, max_new_tokens=plan.MAX_NEW_TOKENS, eos_id=None):
        calls.append(max_new_tokens)
        now[0] += 0.3 + (max_new_tokens - 1) * (0.02 if applied[-1] is None else 0.07)   # prefill, then the steps
        return [1] * max_new_tokens

    @contextlib.contextmanager
    def applying(arm):
        applied.append(arm)
        yield

    arm = SimpleNamespace(to=lambda device: "arm on device")
    s = SimpleNamespace(lm=None, device="cpu", hook=SimpleNamespace(applying=applying))
    monkeypatch.setattr(run_mod.passkey, "greedy", greedy)
    monkeypatch.setattr(run_mod, "clock", lambda device: now[0])
    assert run_mod.decode_step(s, None, [5] * 40) == pytest.approx(0.02)
    assert run_mod.decode_step(s, arm, [5] * 40) == pytest.approx(0.07)
    assert applied == [None, "arm on device"] and calls == [8, 1, 8] * 2


def test_the_first_start_is_counted_once():
    rates = replace(RATES, engine_first_start=40.0)
    phases = dict(estimate(WORK, FULL, COST, rates))
    want = 40 + 4 * 45 + 4 * _scoring(WORK, rates)
    assert phases["engine: 4 arms on 4 start(s)"] == pytest.approx(want)


def test_engine_starts_are_counted_per_serve_configuration():
    """3 arms on one start (scales set in place) + the reference's: 2 starts, every arm's tokens still scored."""
    from dataclasses import replace

    shared = replace(WORK, engine_starts=1)
    phases = dict(estimate(shared, FULL, COST, RATES))
    assert shared.starts == 2 and WORK.starts == 4
    assert phases["engine: 4 arms on 2 start(s)"] == pytest.approx(2 * 45 + 4 * _scoring(WORK))
    skips = dict(estimate(WORK, FULL, COST, RATES))["skip trials: up to 3"]
    assert dict(estimate(shared, FULL, COST, RATES))["skip trials: up to 3"] == skips    # a trial starts its own


def test_a_skip_trial_costs_a_measuring_pass_its_own_passkey_and_one_engine_arm():
    """Per trial: the reference forward and the trial's (KL needs the reference's logits), the trial's passkey
    prompts (the reference's answers are kept from the first pass), one engine start and one arm's scoring."""
    rates = replace(RATES, step_ref=0.05, step_arm=0.125)
    per_pass = sum(COST.work(n) for n, _ in WORK.samples) * (1e-6 + 2e-6)
    passkey = sum(COST.batch([n], 2e-6, 0.125) for n, _, _ in WORK.prompts)
    want = 3 * (per_pass + passkey + 45 + _scoring(WORK, rates))
    assert dict(estimate(WORK, FULL, COST, rates))["skip trials: up to 3"] == pytest.approx(want)


def test_budget_drops_parts_in_the_stated_order():
    assert fit(WORK, FULL, COST, RATES, None).dropped == ()
    assert fit(WORK, FULL, COST, RATES, _total(FULL) + 1).dropped == ()
    parts, expected = FULL, []
    changes = [dict(depths=plan.DEPTH_STEPS[1]), dict(depths=plan.DEPTH_STEPS[2]), dict(skip_trials=0),
               dict(emulate_up_to=2048), dict(emulate_up_to=512), dict(engine_passkey=False)]
    for what, change in zip(ORDER, changes):
        parts = Parts(**{**parts.__dict__, **change})
        expected.append(what)
        got = fit(WORK, FULL, COST, RATES, _total(parts))          # exactly what this step leaves: it stops here
        assert list(got.dropped) == expected and got.parts == parts and got.total == pytest.approx(_total(parts))
    tight = fit(WORK, FULL, COST, RATES, 1.0)
    assert list(tight.dropped) == ORDER
    assert tight.lines(RATES)[-1] == "  the minimum plan still exceeds the budget: running it anyway"


def test_without_engine_or_prompts_only_their_own_parts_drop():
    w = Work(WORK.samples, (), 3, False)
    got = fit(w, FULL, COST, RATES, 1.0)
    assert list(got.dropped) == ["skip trials (up to 3)", "emulated bucket 8192 (not measured)",
                                 "emulated bucket 2048 (not measured)"]


def test_emulation_limit():
    assert plan.emulation_limit(None, (512, 2048), engine=False) is None
    assert plan.emulation_limit(None, (4096, 16384, 32000), engine=True) == 4096
    assert plan.emulation_limit(None, (16384, 32000), engine=True) == 16384        # the smallest always emulated
    assert plan.emulation_limit(3000, (512, 2048, 8192), engine=False) == 2048
    assert plan.emulation_limit(9000, (512, 2048, 8192), engine=True) is None


@pytest.fixture
def model_and_data(tmp_path):
    src = tmp_path / "m"
    tiny_causal_lm("llama").save_pretrained(src)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(16, lo=40, hi=60, seed=2)))
    return src, data


def _eval(src, data, out, *extra):
    from calib.cli import main
    return CliRunner().invoke(main, ["eval", "--model", str(src), "--data", str(data), "--buckets", "32,64",
                                     "--samples", "12", "--no-plots", "--passkey-trials", "0", "--device", "cpu",
                                     "--pack", "--out", str(out), *extra], catch_exceptions=False)


def test_eval_prints_the_plan_and_the_budget_drops_long_buckets(model_and_data, tmp_path, monkeypatch):
    """A probe that says one forward costs minutes: --budget-minutes 1 drops the skip trials and the 64-token
    bucket (no engine, no passkey here), says so before the work and in the report; the progress line
    counts only the samples it emulates."""
    src, data = model_and_data
    monkeypatch.setattr(run_mod, "probe", lambda s, arm, cost, prompts=(): plan.default_rates("cpu", 1e-3, 2e-3, 32))
    r = _eval(src, data, tmp_path / "ev", "--budget-minutes", "1")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("eval plan (probe: one forward at 32 tokens")))
    assert lines[start + 1].startswith("  emulation: reference + 1 arm(s) on 6 samples: ")
    assert "  dropped to fit the budget: skip trials (up to 3); emulated bucket 64 (not measured)" in lines
    assert any(ln.startswith("eval emulation: samples 6/6") for ln in lines)     # packed 32, 64, 32, ...: six of 32
    doc = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert "dropped to fit --budget-minutes: skip trials (up to 3); emulated bucket 64 (not measured)" in doc["notes"]
    assert list(doc["arms"]["default"]["buckets"]) == ["32"] and doc["config"]["budget_minutes"] == 1.0


def test_emulate_up_to_without_a_budget(model_and_data, tmp_path, monkeypatch):
    src, data = model_and_data
    monkeypatch.setattr(run_mod, "probe", lambda s, arm, cost, prompts=(): plan.default_rates("cpu", 1e-9, 1e-9, 32))
    r = _eval(src, data, tmp_path / "ev", "--emulate-up-to", "40")
    assert r.exit_code == 0, r.output
    assert "dropped" not in r.output
    doc = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert any(n.startswith("emulation (per-layer diagnostics, emulated KL/perplexity/passkey) covers buckets <= 32; "
                            "buckets [64] are not measured") for n in doc["notes"])
    assert list(doc["arms"]["default"]["buckets"]) == ["32"]
    r = _eval(src, data, tmp_path / "ev2", "--budget-minutes", "0")
    assert r.exit_code == 1 and "--budget-minutes = 0.0: expected a finite number > 0 and <= 527040" in r.output


def test_on_a_cpu_the_engine_is_costed_by_its_token_rate_alone():
    rates = plan.default_rates("cpu", 1.0, 1.0, 32)          # a reference pass far slower than any engine
    assert rates.engine_over_reference == 0
    tokens = sum(n for n, _ in WORK.samples) + sum(n + plan.MAX_NEW_TOKENS for n, _, _ in WORK.prompts)
    want = 4 * rates.engine_start + 4 * tokens / rates.engine_tokens_per_s
    assert dict(estimate(WORK, FULL, COST, rates))["engine: 4 arms on 4 start(s)"] == pytest.approx(want)


def test_plan_states_both_ends_of_its_conditional_skip_trials():
    """Skip trials run only when the numbers call for them: the plan prints its total with and without them, and
    the total for k trials adds k / planned of the skip phase (the same per-trial figure the plan used)."""
    parts = replace(FULL, skip_trials=3)
    plan = fit(WORK, parts, COST, RATES, None)
    skip = dict(plan.phases)[next(n for n, _ in plan.phases if n.startswith("skip trials"))]
    assert skip > 0
    assert plan.with_trials(3) == pytest.approx(plan.total)
    assert plan.with_trials(0) == pytest.approx(plan.total - skip)
    assert plan.with_trials(1) == pytest.approx(plan.total - skip * 2 / 3)
    total_line = next(x for x in plan.lines(RATES) if x.strip().startswith("total:"))
    assert duration(plan.total) in total_line and duration(plan.total - skip) in total_line
    none = fit(WORK, replace(FULL, skip_trials=0), COST, RATES, None)
    assert none.with_trials(0) == pytest.approx(none.total) and "without" not in " ".join(none.lines(RATES))


def test_the_probe_measures_one_batch_of_the_smallest_buckets_longest_samples(monkeypatch):
    """As the run batches: up to batch_size samples of the smallest bucket, longest first, capped at PROBE_TOKENS
    tokens; the rates are the timed (second) run's seconds over the batch's summed work."""
    from types import SimpleNamespace

    import torch

    from calib.evaluation.samples import Sample
    from calib.evaluation.session import Session

    seen = []

    def measure(sub, arms):
        seen.append([len(x.ids) for x in sub.samples])
        return (SimpleNamespace(seconds=SimpleNamespace(metrics=3.0)),
                {a.name: SimpleNamespace(seconds=SimpleNamespace(metrics=6.0)) for a in arms})

    monkeypatch.setattr(run_mod, "measure", measure)
    lengths = [(30, 32), (25, 32), (32, 32), (20, 32), (31, 32), (60, 64)]
    samples = tuple(Sample(i, tuple(range(n)), b) for i, (n, b) in enumerate(lengths))
    s = Session(torch.nn.Linear(1, 1), None, None, None, samples, (32, 64), batch_size=4)
    arm = SimpleNamespace(name="a")
    rates = run_mod.probe(s, arm, COST)
    assert seen == [[32, 31, 30, 25]] * 2                        # warm-up, then the timed run: the same batch
    work = sum(COST.work(n) for n in (32, 31, 30, 25))
    assert (rates.ref, rates.arm) == (pytest.approx(3.0 / work), pytest.approx(6.0 / work))
    assert (rates.probed_at, rates.probed_batch, rates.step_ref) == (32, 4, 0.0)
    monkeypatch.setattr(run_mod, "PROBE_TOKENS", 70)             # the cap: two samples of 32 tokens fit
    seen.clear()
    capped = run_mod.probe(s, arm, COST)
    assert capped.probed_batch == 2 and seen == [[32, 31]] * 2
    assert "one forward at 32 tokens x 2;" in fit(WORK, FULL, COST, capped, None).lines(capped)[0]


def test_dominance_decides_which_layers_get_skip_trials(model_and_data, tmp_path, monkeypatch):
    """--dominance 1: when no arm passes (a zero bar here), the worst --max-skip layers are tried unquantised even
    if none stands out; a ratio below 1 is refused (below the median layer's error nothing dominates)."""
    src, data = model_and_data
    monkeypatch.setattr(run_mod, "probe", lambda s, arm, cost, prompts=(): plan.default_rates("cpu", 1e-9, 1e-9, 32))
    r = _eval(src, data, tmp_path / "ev", "--max-kl", "0", "--max-ppl-increase", "0", "--max-skip", "1",
              "--dominance", "1")
    assert r.exit_code == 3, r.output             # a zero bar: keep the reference (no-go, calib/errors.py)
    line = next(ln for ln in r.output.splitlines() if ln.startswith("eval: skip trials: "))
    assert line.startswith("eval: skip trials: up to 1 on `default` (layers [")
    doc = json.loads((tmp_path / "ev" / "report.json").read_text())
    layer = int(line.split("(layers [")[1].split("]")[0])
    errs = {int(i): row["attn_rel_error"] for i, row in doc["arms"]["default"]["layers"].items()}
    assert layer == max(errs, key=errs.get)                       # the worst layer by attention-output error
    assert f"default skip {layer}" in doc["arms"] and doc["thresholds"]["dominance"] == 1.0
    bad = _eval(src, data, tmp_path / "ev2", "--dominance", "0.5")
    assert bad.exit_code == 1 and "--dominance = 0.5: expected a finite number >= 1" in bad.output


def test_passkey_batches_stay_in_one_bucket_and_under_the_token_cap():
    """At most `size` prompts and PASSKEY_BATCH_TOKENS tokens a batch, never across buckets; a prompt past the cap
    runs alone (unpadded, so no mask tensor is built for it)."""
    cap = plan.PASSKEY_BATCH_TOKENS
    prompts = [(100, 512)] * 5 + [(cap // 2, cap)] * 3 + [(cap + 5, 2 * cap)] * 2 + [(100, 512)]
    assert plan.batch_indices(prompts, 4) == [[0, 1, 2, 3], [4], [5, 6], [7], [8], [9], [10]]
    assert plan.prompt_batches(prompts, 1) == [[n] for n, _ in prompts]
