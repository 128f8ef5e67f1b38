"""Run an engine runner script in the engine's own interpreter: one subprocess per arm, with a deadline.

Why a subprocess per arm: an engine that refuses a configuration, runs out of memory or hangs must cost
that arm only, never the evaluation — the arm comes back "not run: <one-line reason>" and the others still
run. A fresh process per arm also returns every byte of the engine's memory before the next arm starts.
The runner's stdout carries progress lines (calib/engine/protocol.py) among the engine's own log lines;
the last lines of both streams are kept to explain a failure in one line.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib.engine import protocol
from calib.errors import KvcalibError

RUNNERS = {"vllm": Path(__file__).resolve().parent / "vllm_runner.py"}
RUNNER_ENV = "KVCALIB_ENGINE_RUNNER"       # another runner script speaking the protocol (tests use a fake one)


class EngineError(KvcalibError, ValueError):
    """The engine environment cannot be used at all; the message says what to change."""


@dataclass(frozen=True)
class EngineSpec:
    """Where and how to run an engine. `venv`: the engine's virtual environment (its bin/python runs the
    runner); `top_k`: log-probabilities per position; `kv_gib`: KV-cache pool per run (an integer, GiB)."""
    name: str
    venv: Path
    top_k: int = 20
    kv_gib: int = 1
    timeout: float = 3600.0
    continuation_tokens: int = 16
    chunk: int = 4

    @property
    def python(self) -> Path:
        return Path(self.venv) / "bin" / "python"

    @property
    def runner(self) -> Path:
        return Path(os.environ.get(RUNNER_ENV) or RUNNERS[self.name])


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and protocol.parse_progress(ln) is None]
    return lines[-1][:400] if lines else ""


def check(spec: EngineSpec) -> str:
    """The engine's version; EngineError (one line) when the environment cannot run it."""
    if spec.top_k < 1 or spec.kv_gib < 1:
        raise EngineError(f"--engine-top-k {spec.top_k} / --engine-kv-gib {spec.kv_gib}: both must be >= 1")
    if not spec.python.is_file():
        raise EngineError(f"--vllm-venv {spec.venv}: no bin/python there; give the virtual environment where "
                          f"{spec.name} is installed (`make engine-venv` builds one)")
    try:
        r = subprocess.run([str(spec.python), str(spec.runner), "--probe"], capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired:
        raise EngineError(f"{spec.name} in {spec.venv}: `import {spec.name}` took over 300 s") from None
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("{")), "")
    if r.returncode != 0 or not line:
        why = _last_line(r.stderr) or _last_line(r.stdout) or f"exit code {r.returncode}"
        raise EngineError(f"{spec.name} in {spec.venv} cannot run: {why}")
    return str(json.loads(line).get("version", "unknown"))


def run(spec: EngineSpec, request: dict[str, Any], on_progress: Callable[[dict[str, int]], Any] | None = None,
        version: str = "") -> dict[str, Any]:
    """The runner's response for one arm's request; a response with status not_run (and a one-line reason)
    when the runner fails, exits without answering or passes the deadline."""
    with tempfile.TemporaryDirectory(prefix="kvcalib-engine-") as tmp:
        req, resp = Path(tmp) / "request.json", Path(tmp) / "response.json"
        protocol.write(req, request)
        tail: collections.deque[str] = collections.deque(maxlen=50)
        with open(Path(tmp) / "stderr.log", "w+") as err:
            proc = subprocess.Popen([str(spec.python), str(spec.runner), str(req), str(resp)], stdout=subprocess.PIPE,
                                    stderr=err, text=True, start_new_session=True)

            def read() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    p = protocol.parse_progress(line)
                    if p is None:
                        tail.append(line)
                    elif on_progress is not None:
                        on_progress(p)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            start = time.monotonic()
            try:
                code = proc.wait(timeout=spec.timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return protocol.not_run(f"timed out after {spec.timeout:.0f} s", spec.name, version, spec.kv_gib)
            except BaseException:            # Ctrl-C / SIGTERM: never leave the engine running
                _kill(proc)
                raise
            reader.join(timeout=10)
            err.seek(0)
            stderr = err.read()
        if resp.is_file():
            try:
                return protocol.read(resp, protocol.RESPONSE_FIELDS, f"{spec.name} runner response")
            except protocol.ProtocolError as e:
                return protocol.not_run(str(e), spec.name, version, spec.kv_gib)
        why = _last_line(stderr) or _last_line("".join(tail)) or "no message"
        return protocol.not_run(f"runner exited with code {code} after {time.monotonic() - start:.0f} s: {why}",
                                spec.name, version, spec.kv_gib)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
