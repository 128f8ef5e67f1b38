"""`kvcalib plan --routes`: one decision per route from its evaluation, the exact `vllm serve` command and
plan.json. End to end on a tiny model with the fake engine runner (tests/fake_vllm_runner.py, FP8 through
kvcalib's emulation); the decision rule on hand-made numbers."""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from calib.cli import main
from calib.engine import driver
from calib.evaluation import passkey
from calib.evaluation.markdown import relative
from calib.evaluation.results import passkey_rows
from calib.routes import plan, spec
from helpers import arm_metrics, save_model_and_data
from tiny import tiny_causal_lm

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
VENV = Path(sys.executable).parent.parent


def _route(name="chat", buckets=(512, 2048), **bar) -> spec.Route:
    return spec.Route(name, Path("d.jsonl"), tuple(buckets), spec.Bar(**bar))


def _result(action, arm=None, within=(), skip=(), arms=None, text="Keep BF16 KV for this model: no arm is within "
            "the threshold (best: `default`, perplexity +2.00% > +1%). More."):
    v = SimpleNamespace(action=action, arm=arm, within_threshold=tuple(within), skip_layers=tuple(skip), text=text)
    return SimpleNamespace(verdict=v, arms=arms or {})


def _pk(correct: int, total: int = 10) -> dict:
    return passkey_rows(passkey.summarize([passkey.Outcome(2048, 0.5, "1", "", i < correct) for i in range(total)]))


def test_decisions_and_their_serve_commands():
    cal = arm_metrics(source="/ck/cal", kl=0.004, ppl_rel=0.003)
    default = arm_metrics(kind="default", source=None, kl=0.006)
    r = plan.decide(_route(), "/m/model", _result("ship", "calibrated", ["calibrated", "default"],
                                                  arms={"calibrated": cal, "default": default}))
    assert (r.decision, r.arm, r.serve_model, r.numbers) == ("fp8", "calibrated", "/ck/cal", "emulation")
    assert r.serve == "vllm serve /ck/cal --max-model-len 2048 --kv-cache-dtype fp8"
    assert r.why == "worst-bucket KL 0.004 <= 0.01, ppl +0.30% <= +1%"
    r = plan.decide(_route(), "/m/model", _result("ship", "default", ["default"], arms={"default": default}))
    assert r.serve_argv == ["vllm", "serve", "/m/model", "--max-model-len", "2048", "--kv-cache-dtype", "fp8"]
    trial = arm_metrics(kind="default", source=None, skip=(3, 7))
    r = plan.decide(_route(), "/m/my model", _result("ship_with_skip", "default", skip=(3, 7),
                                                     arms={"default": default, "default skip 3,7": trial}))
    assert r.decision == "fp8_skip" and r.skip_layers == (3, 7)
    assert r.serve == ("vllm serve '/m/my model' --max-model-len 2048 --kv-cache-dtype fp8 "
                       "--kv-cache-dtype-skip-layers 3 7")
    assert shlex.split(r.serve) == r.serve_argv
    for action in ("keep_reference", "skip_unconfirmed"):
        r = plan.decide(_route(), "/m/model", _result(action, "default", arms={"default": default}))
        assert (r.decision, r.kv_cache_dtype, r.serve) == ("bf16", "auto", "vllm serve /m/model --max-model-len 2048")
        assert r.why == "BF16 KV: Keep BF16 KV for this model: no arm is within the threshold (best: `default`, " \
                        "perplexity +2.00% > +1%)"


def test_the_passkey_floor_moves_to_the_next_arm_or_to_bf16():
    low, high = arm_metrics(source="/ck/a", passkey=_pk(6)), arm_metrics(source="/ck/b", passkey=_pk(9))
    res = _result("ship", "a", ["a", "b"], arms={"a": low, "b": high})
    r = plan.decide(_route(min_passkey=0.8), "/m", res)
    assert (r.decision, r.arm) == ("fp8", "b") and r.why.endswith("passkey >= 0.8")
    r = plan.decide(_route(min_passkey=0.95), "/m", res)
    assert r.decision == "bf16" and r.why == ("BF16 KV: `a`: passkey 6/10 < 0.95 in bucket <= 2048; "
                                              "`b`: passkey 9/10 < 0.95 in bucket <= 2048")
    no_pk = _result("ship", "a", ["a"], arms={"a": arm_metrics(source="/ck/a")})
    assert "no passkey was run" in plan.decide(_route(min_passkey=0.5), "/m", no_pk).why
    # an INT8 arm within the bar has no vLLM form: not chosen
    int8 = _result("ship", "i", ["i"], arms={"i": arm_metrics(dtype="int8", source="/ck/i")})
    assert plan.decide(_route(), "/m", int8).decision == "bf16"


@pytest.fixture(scope="module")
def two_routes(tmp_path_factory):
    """A tiny model (context 128) and two routes: short chat with a loose bar, long documents with a bar no FP8
    arm can meet (KL 0)."""
    tmp = tmp_path_factory.mktemp("routes")
    src, data = save_model_and_data(tmp, tiny_causal_lm("llama", max_position_embeddings=128), "model")
    lines = data.read_text().splitlines()
    (tmp / "chat.jsonl").write_text("\n".join(lines[:32]) + "\n")
    (tmp / "docs.jsonl").write_text("\n".join(lines[32:]) + "\n")
    (tmp / "routes.yaml").write_text(
        "routes:\n"
        "  chat: {data: chat.jsonl, buckets: [32, 64], samples: 4, bar: {max_kl: 1.0, max_ppl_increase: 1.0}}\n"
        "  docs: {data: docs.jsonl, buckets: [128], samples: 2, pack: true, bar: {max_kl: 0, max_ppl_increase: 0}}\n")
    return tmp, src


def test_two_routes_end_to_end(two_routes, monkeypatch):
    tmp, src = two_routes
    monkeypatch.setenv(driver.RUNNER_ENV, str(FAKE))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")
    out = tmp / "plan"
    r = CliRunner().invoke(main, ["plan", "--routes", str(tmp / "routes.yaml"), "--model", str(src), "--device", "cpu",
                                  "--max-skip", "0", "--no-plots", "--no-progress", "--engine", "vllm",
                                  "--vllm-venv", str(VENV), "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    chat, docs = doc["routes"]["chat"], doc["routes"]["docs"]
    assert (chat["decision"], chat["arm"], chat["numbers"]) == ("fp8", "default", "engine")
    assert chat["serve"] == f"vllm serve {src} --max-model-len 64 --kv-cache-dtype fp8"
    assert (docs["decision"], docs["kv_cache_dtype"], docs["arm"]) == ("bf16", "auto", None)
    assert docs["serve"] == f"vllm serve {src} --max-model-len 128" and docs["why"].startswith("BF16 KV: Keep FP32 KV")
    assert doc["servers"] == [{"serve": chat["serve"], "routes": ["chat"]}, {"serve": docs["serve"], "routes": ["docs"]}]
    for name in ("chat", "docs"):
        rep = json.loads((out / name / "report.json").read_text())
        assert rep["data"]["source"] == str(tmp / f"{name}.jsonl")
        assert rep["arms"]["default"]["engine"]["status"] == "ok"
    assert json.loads((out / "docs" / "report.json").read_text())["buckets"] == [128]
    assert f"chat: fp8 — {chat['serve']}" in r.output
    md = (out / "plan.md").read_text()
    lines = md.splitlines()
    assert lines[:3] == [f"# Serving plan: `{relative(str(src))}`", "",
                         "**chat → FP8 KV (`default`); docs → keep FP32 KV**: 2 servers, the whole command below."]
    assert lines[4:9] == [           # the tiny model is FP32 itself: keeping the reference keeps FP32
        "| route | decision | arm | quality (worst-bucket KL, Δppl vs the route's bar) | KV capacity vs FP32 | "
        "speed (goodput at the SLO vs FP32) | buckets | why |", "|---|---|---|---|---|---|---|---|",
        f"| chat | **FP8 KV** | `default` | {_kl_cell(out / 'chat', 'default', 1.0, 1.0)} | 4.00x (engine's count) at "
        f"64 tokens | not measured | 32, 64 | {chat['why']} |",
        f"| docs | **keep FP32 KV** | FP32 KV (reference) | reference | 1.00x (engine's count) at 128 tokens | "
        f"not measured | 128 | {relative(docs['why'])} |", ""]
    assert lines[9:19] == ["Routes chat:", "", "```", relative(chat["serve"]), "```", "",
                           "Routes docs:", "", "```", relative(docs["serve"])]
    assert not re.findall(r"(?<![\w.~/-])/[\w.-]+/", md)


def _kl_cell(folder: Path, arm: str, max_kl: float, max_ppl: float) -> str:
    """The plan's quality cell for a route's arm, from its report.json's engine numbers (independent of plan.py)."""
    s = json.loads((folder / "report.json").read_text())["arms"][arm]["engine"]["summary"]
    return (f"KL {s['max_bucket_kl']:.3g} {'<=' if s['max_bucket_kl'] <= max_kl else '>'} {max_kl:g}, Δppl "
            f"{100 * s['ppl_rel']:+.2f}% {'<=' if s['ppl_rel'] <= max_ppl else '>'} +{100 * max_ppl:g}% (engine)")


def test_plan_md_of_one_server_opens_with_its_command_and_reads_speed_under_load(tmp_path, monkeypatch):
    """plan.md from hand-made documents: a BF16 model's route that keeps BF16 under load, one server."""
    monkeypatch.chdir(tmp_path)
    route = _route("chat", (512,))
    d = plan.Decision("chat", plan.BF16, None, str(tmp_path / "m"), "auto", (), 512, "engine under load",
                      "BF16 KV: FP8 KV buys nothing for this workload")
    doc = plan.plan_doc(str(tmp_path / "m"), spec.Routes(tmp_path / "routes.yaml", (route,)), [d])
    report = {"serving_dtype": "bfloat16", "reference": "fp32", "verdict": {"capacity": {"length": 512, "arms": [
        {"arm": "fp32", "vs_reference": 1.0, "source": "bytes model"}]}}}
    served = {"reference": "fp32", "decision": {"overall": {"goodput_vs_reference": {"fp32": 1.0, "default": 0.97}}}}
    md = plan.markdown(doc, {"chat": {"eval": report, "validate": served}}).splitlines()
    assert md[:11] == [
        "# Serving plan: `m`", "", "**chat → keep BF16 KV**: 1 server, the whole command below.", "",
        "| route | decision | arm | quality (worst-bucket KL, Δppl vs the route's bar) | KV capacity vs BF16 | "
        "speed (goodput at the SLO vs BF16) | buckets | why |", "|---|---|---|---|---|---|---|---|",
        "| chat | **keep BF16 KV** | BF16 KV (reference) | reference | 1.00x (bytes model) at 512 tokens | 1.00x | 512 | "
        "BF16 KV: FP8 KV buys nothing for this workload |", "", "```", "vllm serve m --max-model-len 512", "```"]
    assert shlex.split(d.serve)[2] == str(tmp_path / "m")           # plan.json keeps the whole path
    assert "Routes file: `routes.yaml`. Each route's evaluation: `<route>/report.md` and its serving under load " \
           "`<route>/validate.md`." in md


def test_a_bad_route_stops_the_plan_before_any_model_loads(two_routes, tmp_path):
    tmp, src = two_routes
    routes = tmp_path / "routes.yaml"
    (tmp_path / "chat.jsonl").write_text((tmp / "chat.jsonl").read_text())
    (tmp_path / "empty.jsonl").write_text("")
    routes.write_text("routes:\n  chat: {data: chat.jsonl, buckets: [32]}\n  docs: {data: empty.jsonl, buckets: [64]}\n")
    r = CliRunner().invoke(main, ["plan", "--routes", str(routes), "--model", str(tmp_path / "no-model"),
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and r.output.strip().splitlines() == [
        f"Error: routes file {routes} route 'docs' field 'data': {tmp_path}/empty.jsonl is empty; give the route "
        "held-out records"]
    routes.write_text("routes:\n  chat: {data: chat.jsonl, buckets: [32]}\n  docs: {data: chat.jsonl, buckets: [512]}\n")
    r = CliRunner().invoke(main, ["plan", "--routes", str(routes), "--model", str(src), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and r.output.strip().splitlines() == [
        f"Error: {routes}: route 'docs': --buckets 512: longer than the context of MODEL {src} (128 tokens: "
        "max_position_embeddings 128); use buckets of at most 128"]
    assert not (tmp_path / "o").exists()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_plan_never_writes_over_or_into_what_it_reads(two_routes, tmp_path):
    """`--out` is never a --scales checkpoint (a kvcalib output, which --force alone would replace), a route's
    data, the routes file or the model, and never lies inside one: refused before any model loads."""
    from helpers import calibrate_small

    tmp, src = two_routes
    ck = calibrate_small(src, tmp / "chat.jsonl", tmp_path / "ck")
    data = tmp_path / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text((tmp / "chat.jsonl").read_text())
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes:\n  chat: {data: data, buckets: [32]}\n")
    before = _snapshot(tmp_path)
    for out, message in ((ck, f"--out {ck} is a --scales checkpoint ({ck}); choose a new path"),
                         (data, f"--out {data} is route 'chat' data ({data}); choose a new path"),
                         (ck / "plan", f"--out {ck / 'plan'} is inside a --scales checkpoint ({ck})"),
                         (src / "plan", f"--out {src / 'plan'} is inside the model folder ({src})")):
        r = CliRunner().invoke(main, ["plan", "--routes", str(routes), "--model", str(src), "--scales", str(ck),
                                      "--out", str(out), "--force", "--device", "cpu"])
        assert r.exit_code == 1 and len(r.output.splitlines()) == 1 and r.output.startswith(f"Error: {message}"), \
            r.output
    assert _snapshot(tmp_path) == before


def test_sigterm_during_plan_removes_its_temporary_folder_and_lock(two_routes, tmp_path):
    """SIGTERM / SIGHUP unwind like Ctrl-C while the routes are evaluated: no plan, no temporary folder, no lock."""
    import signal
    import subprocess

    from helpers import default_sigint

    tmp, src = two_routes
    code = ("import sys, time\nimport calib.evaluation.run as mod\n"
            "def slow(*a, **k):\n    print('STAGE-REACHED', flush=True)\n    time.sleep(60)\n"
            "mod.run_eval = slow\nfrom calib.cli import main\nsys.argv = ['kvcalib', *sys.argv[1:]]\nmain()\n")
    home = tmp_path / "plans"
    for sig in (signal.SIGTERM, signal.SIGHUP):
        proc = subprocess.Popen([sys.executable, "-c", code, "plan", "--routes", str(tmp / "routes.yaml"), "--model",
                                 str(src), "--device", "cpu", "--out", str(home / "plan")], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "STAGE-REACHED" in line:
                break
        assert "STAGE-REACHED" in "".join(seen), "".join(seen)
        # the signal lands while the temporary plan folder and its lock exist beside OUT
        assert [p.name for p in home.glob(".plan.kvcalib-tmp-*")] and (home / ".plan.kvcalib-lock").exists()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert not home.exists() or list(home.iterdir()) == []


def test_plan_serve_decides_each_route_by_goodput_under_its_load(tmp_path, monkeypatch):
    """`plan --serve`: each route's arms served under load (the fake server, tests/fake_vllm_cli.py: a pool of 500
    tokens for the model dtype). Short chat prompts (32 tokens) fit 9 requests with BF16 KV, more than the 8 in
    flight: FP8's slower steps lose and the route keeps BF16. Documents (64 tokens) fit 5 with BF16 and 11 with
    FP8: FP8 serves more at 8 in flight and the route takes it, with its serve command."""
    from calib.load import server
    from helpers import SAMPLE_TEXT, train_tokenizer

    tok = train_tokenizer()
    m = tiny_causal_lm("llama", vocab_size=len(tok), max_position_embeddings=256)
    m.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "routes.yaml").write_text(
        f"routes:\n"
        f"  chat: {{data: {SAMPLE_TEXT}, buckets: [32], samples: 4, pack: true, bar: {{max_kl: 1.0, max_ppl_increase: 1.0}}}}\n"
        f"  docs: {{data: {SAMPLE_TEXT}, buckets: [64], samples: 4, pack: true, bar: {{max_kl: 1.0, max_ppl_increase: 1.0}}}}\n")
    monkeypatch.setenv(driver.RUNNER_ENV, str(FAKE))
    monkeypatch.setenv(server.CLI_ENV, str(Path(__file__).resolve().parents[1] / "fake_vllm_cli.py"))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")
    monkeypatch.setenv("FAKE_BYTES_PER_TOKEN", str((1 << 30) // 500))
    out = tmp_path / "plan"
    r = CliRunner().invoke(main, ["plan", "--routes", str(tmp_path / "routes.yaml"), "--model", str(tmp_path / "model"),
                                  "--device", "cpu", "--max-skip", "0", "--passkey-trials", "0", "--no-plots",
                                  "--no-progress", "--engine", "vllm", "--vllm-venv", str(VENV), "--serve",
                                  "--output-tokens", "4", "--max-concurrency", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    chat, docs = doc["routes"]["chat"], doc["routes"]["docs"]
    assert chat["decision"] == "bf16" and "buys nothing" in chat["why"] and chat["numbers"] == "engine under load"
    assert docs["decision"] == "fp8" and docs["numbers"] == "engine under load" and "--kv-cache-dtype fp8" in docs["serve"]
    for name in ("chat", "docs"):
        served = json.loads((out / name / "validate.json").read_text())
        rec = served["decision"]["overall"]["recommended"]
        assert (rec == served["reference"]) == (name == "chat")
        if name == "docs":
            assert docs["arm"] == rec and served["arms"][rec]["buckets"]["64"]["capacity"] == 11


def test_plan_serve_needs_the_engine(two_routes, tmp_path):
    tmp, src = two_routes
    r = CliRunner().invoke(main, ["plan", "--routes", str(tmp / "routes.yaml"), "--model", str(src), "--serve",
                                  "--out", str(tmp_path / "p")])
    assert r.exit_code != 0 and "--serve needs --engine vllm" in r.output and not (tmp_path / "p").exists()


def test_a_route_whose_data_yields_no_sample_stops_the_plan_before_the_first_route_runs(two_routes, tmp_path,
                                                                                        monkeypatch):
    """The second route's records are all shorter than min_tokens: the plan stops with one line naming that route
    before the first route is evaluated (no evaluation starts, nothing is written)."""
    import json as _json

    from calib.evaluation import run as eval_run

    tmp, src = two_routes
    (tmp_path / "chat.jsonl").write_text((tmp / "chat.jsonl").read_text())
    (tmp_path / "tiny.jsonl").write_text("".join(_json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(5)))
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes:\n  chat: {data: chat.jsonl, buckets: [32]}\n  docs: {data: tiny.jsonl, buckets: [64]}\n")
    started = []
    monkeypatch.setattr(eval_run, "run_eval", lambda *a, **k: started.append(a) or pytest.fail("a route ran"))
    r = CliRunner().invoke(main, ["plan", "--routes", str(routes), "--model", str(src), "--device", "cpu",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"{routes}: route 'docs':" in r.output and "min_tokens" in r.output, r.output
    assert not started and not (tmp_path / "o").exists()
