"""The engine runner's output is untrusted input (calib/engine/protocol.py, driver.py): a malformed answer is one
EngineError naming the field, never a traceback or an arm's numbers; a runner that exits 0 without answering is
an error too; logs are bounded; the runner and its folder never outlive kvcalib.

The runners here are tiny scripts written per test (no model, no torch): they copy a prepared answer, print
logs, exit with a chosen code or sleep, so each case is exact and fast.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calib.engine import answer as checked, driver, protocol
from calib.engine.driver import EngineError, EngineSpec
from helpers import default_sigint

VENV = Path(sys.executable).parent.parent
REPO = Path(__file__).resolve().parent.parent

RUNNER = """
import os, sys, time
from pathlib import Path
if sys.argv[1:2] == ["--probe"]:
    sys.stdout.write(os.environ.get("T_PROBE", '{"engine": "vllm", "version": "0.0-test"}') + "\\n")
    sys.exit(0)
for _ in range(int(os.environ.get("T_LOG_LINES", "0"))):
    print("x" * int(os.environ.get("T_LOG_WIDTH", "100")), flush=True)
if os.environ.get("T_LONG_LINE"):
    sys.stdout.write("y" * int(os.environ["T_LONG_LINE"]))
    sys.stdout.flush()
    print()
if os.environ.get("T_PROGRESS"):
    print(os.environ["T_PROGRESS"], flush=True)
if os.environ.get("T_SLEEP"):
    Path(os.environ["T_PIDFILE"]).write_text(str(os.getpid()))
    time.sleep(float(os.environ["T_SLEEP"]))
if os.environ.get("T_ANSWER"):
    Path(sys.argv[2]).write_bytes(Path(os.environ["T_ANSWER"]).read_bytes())
sys.exit(int(os.environ.get("T_EXIT", "0")))
"""

SCALES = {"layout": "tensor", "layers": [{"layer": 0, "k": [0.5], "v": [0.25], "q": [1.0]}]}
REQUEST = {"protocol": 2, "arms": [{"name": "default", "model": "m", "kv_cache_dtype": "fp8", "skip_layers": [],
                                    "scales": SCALES}],
           "samples": [[1, 2, 3], [4, 5, 6, 7]], "continuation_tokens": 2, "passkey": [[8, 9]], "passkey_tokens": 3,
           "stop_token_ids": [], "top_k": 2, "kv_gib": 1, "max_model_len": 16, "dtype": "float32", "seed": 0,
           "chunk": 1}


def good_arm() -> dict:
    def row(n):
        return {"target": [-0.5] * n, "top_ids": [[3, 1] for _ in range(n)],
                "top_logprobs": [[-0.1, -2.5] for _ in range(n)]}
    return {"status": "ok", "reason": None, "engine": "vllm", "version": "0.0-test",
            "kv_cache_dtype": "fp8", "kv_capacity_tokens": 4096, "kv_gib": 1, "seconds": {"all": 0.5},
            "samples": [row(2), row(3)], "continuations": [[1, 2], [3]], "passkey": [[7, 7, 7]],
            "scales": {"layers": [{"layer": 0, "k": [0.5], "v": [0.25], "q": [1.0], "k_float": 0.5, "v_float": 0.25,
                                   "q_float": 1.0}]}}


def good_answer() -> dict:
    return {"protocol": 2, "arms": [good_arm()]}


@pytest.fixture
def runner(tmp_path, monkeypatch):
    """A runner script in tmp_path, used through KVCALIB_ENGINE_RUNNER; returns a function that sets the case."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    monkeypatch.setenv(driver.RUNNER_ENV, str(script))
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(driver.tempfile, "tempdir", str(tmpdir))

    def case(answer: dict | bytes | str | None = None, **env: str) -> Path:
        for k in [k for k in os.environ if k.startswith("T_")]:
            monkeypatch.delenv(k)
        if answer is not None:
            path = tmp_path / "answer.json"
            data = answer if isinstance(answer, bytes) else (
                answer if isinstance(answer, str) else json.dumps(answer)).encode()
            path.write_bytes(data)
            monkeypatch.setenv("T_ANSWER", str(path))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return tmpdir
    return case


def _groups(**group) -> dict:
    """A well-formed `kv_groups` answer (one global group) with `group`'s fields replaced."""
    g = {"layers": [0, 1], "spec": "FullAttentionSpec", "dtype": "bfloat16", "block_size": 16, "page_bytes": 4096,
         "window": None, **group}
    return {"size_tokens": 4096, "max_concurrency": 2.0, "max_model_len": 2048, "num_blocks": 256,
            "in_flight_tokens": 2048, "groups": [g]}


def spec(**kw) -> EngineSpec:
    return EngineSpec("vllm", VENV, top_k=2, **kw)


def broken(answer, **env) -> str:
    """The one-line error of a run whose runner answers `answer`."""
    with pytest.raises(EngineError) as e:
        driver.run(spec(), REQUEST)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


def test_a_good_answer_passes_unchanged(runner):
    runner(good_answer())
    assert driver.run(spec(), REQUEST) == good_answer()


@pytest.mark.parametrize("edit, says", [
    (lambda a: a["samples"][0]["target"].__setitem__(0, "-0.5"), "samples[0].target[0] = '-0.5': expected a finite number <= 0.0001"),
    (lambda a: a["samples"][1]["target"].__setitem__(2, 1000.0), "samples[1].target[2] = 1000.0: expected a finite number <= 0.0001"),
    (lambda a: a["samples"][0]["top_logprobs"][1].__setitem__(0, math.nan), "top_logprobs[1][0] = nan"),
    (lambda a: a["samples"][0]["top_logprobs"][1].__setitem__(0, -math.inf), "top_logprobs[1][0] = -inf"),
    (lambda a: a["samples"][0]["top_ids"].__setitem__(0, [3, "1"]), "samples[0].top_ids[0][1] = '1': expected a whole"),
    (lambda a: a["samples"][0]["top_ids"].__setitem__(0, [3, True]), "samples[0].top_ids[0][1] = True"),
    (lambda a: a["samples"][0]["top_ids"].__setitem__(0, [3, 1, 4]), "top_ids[0] holds 3 entries: expected at most 2"),
    (lambda a: a["samples"][0]["top_logprobs"].__setitem__(0, [-0.1]), "top_logprobs[0] holds 1 entries: expected 2"),
    (lambda a: a["samples"].pop(), "samples holds 1 entries: expected 2"),
    (lambda a: a["samples"][1]["target"].pop(), "samples[1].target holds 2 entries: expected 3"),
    (lambda a: a.__setitem__("kv_capacity_tokens", "lots"), "kv_capacity_tokens = 'lots': expected a whole number"),
    (lambda a: a.__setitem__("kv_capacity_tokens", -5), "kv_capacity_tokens = -5"),
    (lambda a: a.__setitem__("seconds", {"all": "fast"}), "seconds.all = 'fast'"),
    (lambda a: a.__setitem__("continuations", [[1, 2, 3], [3]]), "continuations[0] holds 3 entries"),
    (lambda a: a.__setitem__("passkey", []), "passkey holds 0 entries: expected 1"),
    (lambda a: a.__setitem__("status", "great"), "status = 'great'"),
    (lambda a: a.__setitem__("version", 7), "version = 7: expected a string"),
    (lambda a: a.__setitem__("protocol", 1), "protocol 1"),
    (lambda a: a.pop("samples"), "arms[0]: missing field(s) samples"),
    (lambda a: a.__setitem__("bonus", 1), "arms[0]: unknown field(s) bonus"),
    (lambda a: a.__setitem__("bonus", 1), "response: unknown field(s) bonus"),
    (lambda a: a.__setitem__("arms", []), "arms holds 0 entries: expected 1"),
    (lambda a: a["scales"]["layers"][0].__setitem__("k", [0.0]), "arms[0].scales.layers[0].k[0] = 0.0: expected a finite number > 0"),
    (lambda a: a["scales"]["layers"][0].__setitem__("v", []), "arms[0].scales.layers[0].v holds 0 entries: expected 1 to 1024"),
    (lambda a: a["scales"]["layers"][0].__setitem__("q_float", math.inf), "arms[0].scales.layers[0].q_float = inf"),
    (lambda a: a["scales"]["layers"][0].pop("layer"), "arms[0].scales.layers[0]: missing field(s) layer"),
    (lambda a: a["scales"].__setitem__("layers", {}), "arms[0].scales.layers = {}: expected a list"),
    # a hostile capacity answer: zero sizes, no groups, counts past any engine's pool (each a divisor downstream)
    (lambda a: a.__setitem__("kv_groups", _groups(block_size=0)), "kv_groups.groups[0].block_size = 0"),
    (lambda a: a.__setitem__("kv_groups", _groups(page_bytes=0)), "kv_groups.groups[0].page_bytes = 0"),
    (lambda a: a.__setitem__("kv_groups", _groups(window=0)), "kv_groups.groups[0].window = 0"),
    (lambda a: a.__setitem__("kv_groups", {**_groups(), "groups": []}), "kv_groups.groups holds 0 entries: expected 1 to 4096"),
    (lambda a: a.__setitem__("kv_groups", {**_groups(), "max_model_len": 0}), "kv_groups.max_model_len = 0"),
    (lambda a: a.__setitem__("kv_groups", {**_groups(), "num_blocks": 10 ** 30}), "kv_groups.num_blocks = 1000"),
    (lambda a: a.__setitem__("kv_groups", _groups(layers=[])), "kv_groups.groups[0].layers holds 0 entries: expected 1 to 100000"),
    (lambda a: a.__setitem__("kv_capacity_tokens", 10 ** 20), "kv_capacity_tokens = 1000"),
])
def test_a_malformed_answer_is_one_error_naming_the_field(runner, edit, says):
    answer = good_answer()
    edit(answer if says.startswith(("protocol", "response", "arms holds")) else answer["arms"][0])
    runner(answer)
    msg = broken(answer)
    assert says in msg and "broke the protocol" in msg, msg


@pytest.mark.parametrize("raw, says", [
    ('{"protocol": 1, "status": "ok", ', "not valid JSON"),
    ("[1, 2, 3]", "expected a JSON object, got list"),
    (b"\xff\xfe{}", "not UTF-8"),
    ("[" * 100_000 + "]" * 100_000, "not usable JSON"),
    ('{"protocol": 1' + "0" * 5000 + "}", "not usable JSON"),
])
def test_an_answer_that_is_not_json_is_one_error(runner, raw, says):
    runner(raw)
    assert says in broken(raw)


def test_an_answer_larger_than_the_request_can_produce_is_not_read(runner):
    answer = good_answer()
    answer["version"] = "v" * (checked.response_cap(REQUEST) + 10)
    runner(answer)
    assert "more than the" in broken(answer)


def test_a_runner_that_exits_0_without_an_answer_is_an_error(runner):
    runner(T_EXIT="0")
    with pytest.raises(EngineError, match="exited 0 without writing its response"):
        driver.run(spec(), REQUEST)


def test_a_not_run_answer_keeps_only_a_cleaned_reason(runner):
    runner(protocol.answer([{**protocol.not_run("boom\nsecond line \ud800", "vllm", "1.0", 1), "samples": "ignored"}]))
    r = driver.run(spec(), REQUEST)["arms"][0]
    assert r["status"] == "not_run" and r["reason"] == "boom second line \ufffd" and r["samples"] == []


def test_megabytes_of_log_and_one_endless_line_are_bounded(runner):
    runner(good_answer(), T_LOG_LINES="20000", T_LOG_WIDTH="500", T_LONG_LINE=str(8 << 20))
    assert driver.run(spec(), REQUEST) == good_answer()
    runner(None, T_LOG_LINES="20000", T_LOG_WIDTH="500", T_EXIT="4")
    r = driver.run(spec(), REQUEST)["arms"][0]
    assert r["status"] == "not_run" and r["reason"].startswith("runner exited with code 4")
    assert len(r["reason"]) < 500


def test_progress_lines_with_wrong_types_are_logs_not_numbers(runner):
    seen = []
    runner(good_answer(), T_PROGRESS=json.dumps({"progress": {"tokens": "9", "samples": 1, "passkey": 0}}))
    driver.run(spec(), REQUEST, seen.append)
    assert seen == []
    assert protocol.parse_progress(protocol.progress_line(5, 1, 0)) == {"tokens": 5, "samples": 1, "passkey": 0, "arm": 0}
    assert protocol.parse_progress(protocol.progress_line(5, 1, 0, 2))["arm"] == 2
    assert protocol.parse_progress(json.dumps({"progress": {"tokens": 5, "samples": 1, "passkey": 0, "arm": -1}})) is None


def test_a_probe_answer_that_is_not_the_protocols_is_one_line(runner):
    runner(T_PROBE="{broken")
    with pytest.raises(EngineError, match="--probe answer"):
        driver.check(spec())
    runner(T_PROBE='{"engine": "vllm", "version": ["1"]}')
    with pytest.raises(EngineError, match="--probe answer"):
        driver.check(spec())
    runner()
    assert driver.check(spec()) == "0.0-test"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:                 # a zombie is dead
        return f.read().split(") ")[1][0] != "Z"


def _wait_for(path: Path, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert path.exists()


DRIVE = """
import json, sys
sys.path.insert(0, {repo!r})
from calib.engine import driver
spec = driver.EngineSpec("vllm", {venv!r}, top_k=2)
driver.run(spec, json.loads({request!r}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_kvcalib_ending_during_an_engine_run_leaves_no_runner_and_no_folder(runner, tmp_path, sig):
    tmpdir = runner(T_SLEEP="120", T_PIDFILE=str(tmp_path / "runner.pid"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kv = subprocess.Popen([sys.executable, "-c", DRIVE.format(repo=str(REPO), venv=str(VENV),
                                                              request=json.dumps(REQUEST))], env=env,
                          preexec_fn=default_sigint)
    _wait_for(tmp_path / "runner.pid")
    child = int((tmp_path / "runner.pid").read_text())
    assert _alive(child) and len(list(tmpdir.iterdir())) == 1
    kv.send_signal(sig)
    kv.wait(timeout=60)
    end = time.monotonic() + 30
    while _alive(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(child)
    if sig == signal.SIGKILL:                 # no cleanup code ran: the next run removes the dead run's folder
        left = list(tmpdir.iterdir())
        assert len(left) == 1 and left[0].name.startswith(f"{driver.DIR_PREFIX}{kv.pid}-")
        assert driver.sweep(tmpdir) == left
    assert list(tmpdir.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux")
def test_the_sweep_kills_what_still_works_in_a_dead_runs_folder_and_spares_live_runs(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{driver.DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{driver.DIR_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "kvcalib-engine-notapid"
    for d in (stale, live, other):
        d.mkdir()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              env={**os.environ, driver.DIR_ENV: str(stale)})
    link = tmp_path / f"{driver.DIR_PREFIX}{dead.pid}-link"
    link.symlink_to(live)
    try:
        assert driver.sweep(tmp_path) == [stale]
        assert orphan.wait(timeout=30) == -signal.SIGKILL
        assert live.is_dir() and other.is_dir() and link.is_symlink()
    finally:
        if orphan.poll() is None:
            orphan.kill()


REQUESTS = st.fixed_dictionaries({
    "samples": st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=1, max_size=3),
    "top_k": st.integers(1, 3), "continuation_tokens": st.integers(0, 3), "passkey_tokens": st.integers(0, 3),
    "passkey": st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=3), max_size=2)})
JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(req=REQUESTS, data=st.data())
def test_checked_answers_hold_only_valid_numbers_or_raise_protocol_error(req, data):
    """Any JSON value, or an honest answer with one leaf replaced by junk: either a ProtocolError, or an answer
    every metric can use (right lengths, finite log-probabilities <= 0, whole non-negative ids)."""
    req = {**req, "arms": [{"name": "a", "scales": None}]}
    arm = {"status": "ok", "reason": None, "engine": "vllm", "version": "1",
           "kv_cache_dtype": "fp8", "kv_capacity_tokens": 16, "kv_gib": 1, "seconds": {},
           "samples": [{"target": [-1.0] * (len(s) - 1), "top_ids": [[0] * req["top_k"]] * (len(s) - 1),
                        "top_logprobs": [[-1.0] * req["top_k"]] * (len(s) - 1)} for s in req["samples"]],
           "continuations": [[1] * req["continuation_tokens"] for _ in req["samples"]],
           "passkey": [[2] * max(1, req["passkey_tokens"]) for _ in req["passkey"]],
           "scales": {"layers": [{"layer": 0, "k": [0.5], "v": [0.5], "q": [1.0], "k_float": 0.5, "v_float": 0.5,
                                  "q_float": 1.0}]}}
    honest = {"protocol": 2, "arms": [arm]}
    doc = _poke(honest, data) if data.draw(st.booleans()) else data.draw(JUNK)
    try:
        out = checked.check_response(doc, req)
    except protocol.ProtocolError as e:
        assert "\n" not in str(e)
        return
    out = out["arms"][0]
    for row in (out["scales"] or {"layers": []})["layers"]:
        vals = [*row["k"], *row["v"], *row["q"], row["k_float"], row["v_float"], row["q_float"]]
        assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in vals) and type(row["layer"]) is int
    if out["status"] == "not_run":
        assert isinstance(out["reason"], str)
        return
    assert len(out["samples"]) == len(req["samples"]) and len(out["passkey"]) == len(req["passkey"])
    for ids, row in zip(req["samples"], out["samples"]):
        assert len(row["target"]) == len(row["top_ids"]) == len(row["top_logprobs"]) == len(ids) - 1
        lps = [*row["target"], *(x for r in row["top_logprobs"] for x in r)]
        assert all(isinstance(x, float) and math.isfinite(x) and x <= 0 for x in lps)
        assert all(type(i) is int and i >= 0 for r in row["top_ids"] for i in r)


def _poke(doc, data):
    """`doc` with one node (chosen by hypothesis) replaced by junk."""
    doc = json.loads(json.dumps(doc))
    node, parent, key = doc, None, None
    for _ in range(6):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        parent, key = node, data.draw(st.sampled_from(keys))
        if not isinstance(node[key], (dict, list)) or data.draw(st.booleans()):
            break
        node = node[key]
    if parent is not None:
        parent[key] = data.draw(JUNK)
    return doc
