"""Run an engine runner script in the engine's own interpreter: one subprocess per engine start (the arms
that share one serve configuration, calib/engine/protocol.py), with a deadline.

Why a subprocess per start: an engine that refuses a configuration, runs out of memory or hangs must cost
those arms only, never the evaluation — they come back "not run: <one-line reason>" and the others still
run. A fresh process per start also returns every byte of the engine's memory before the next one starts.
The runner's stdout carries progress lines (calib/engine/protocol.py) among the engine's own log lines;
the last lines of both streams are kept (bounded: a line is cut at MAX_LINE bytes, TAIL lines are kept) to
explain a failure in one line.

What the runner writes is untrusted input (`answer.read_response`): a response that breaks the protocol,
or a runner that exits 0 without one, is an EngineError (one line, non-zero exit), never an arm's numbers.

The runner dies with kvcalib, however kvcalib ends. It runs in its own process group (the group is killed
on a deadline, an error, Ctrl-C, SIGTERM or SIGHUP), and on Linux with a parent-death signal (prctl
PR_SET_PDEATHSIG, set between fork and exec): a SIGKILLed kvcalib takes the runner with it. Its files live
in `TMPDIR/kvcalib-engine-<kvcalib pid>-*`, removed when the arm ends; one left by a kvcalib that was
SIGKILLed (its pid no longer runs) is removed by the next run, after any process still working in it (a
runner's own children, which no parent-death signal reaches) is killed: processes are found by the
KVCALIB_ENGINE_DIR their environment carries.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from calib.engine import answer, protocol
from calib.errors import KvcalibError
from calib.safety import files, outputs
from calib.safety.readers import clean_text

RUNNERS = {"vllm": Path(__file__).resolve().parent / "vllm_runner.py"}
RUNNER_ENV = "KVCALIB_ENGINE_RUNNER"       # another runner script speaking the protocol (tests use a fake one)
DIR_ENV = "KVCALIB_ENGINE_DIR"             # set in the runner's environment: finds its processes after a crash
DIR_PREFIX = "kvcalib-engine-"
MAX_LINE = 64 << 10                        # bytes of one log line read at a time
TAIL = 50                                  # log lines kept per stream
PROBE_TIMEOUT = 300.0


class EngineError(KvcalibError, ValueError):
    """The engine environment cannot be used, or its runner broke the protocol; the message says what to do."""


@dataclass(frozen=True)
class EngineSpec:
    """Where and how to run an engine. `venv`: the engine's virtual environment (its bin/python runs the
    runner); `top_k`: log-probabilities per position; `kv_gib`: KV-cache pool per run (an integer, GiB);
    `timeout`: seconds per arm (a run serving n arms on one start gets n times this)."""
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


# ------------------------------------------------------------------------------------------- children

def parent_death_signal() -> Callable[[], None] | None:
    """A preexec function that asks Linux to SIGKILL the child when kvcalib dies (None elsewhere). libc is
    resolved here, in the parent: between fork and exec only the call itself runs."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)        # PR_SET_PDEATHSIG
        if os.getppid() != parent:               # kvcalib died before the call: the signal would never come
            os._exit(1)
    return preexec


def _pump(stream: IO[bytes], tail: collections.deque, on_progress: Callable[[dict[str, int]], Any] | None) -> None:
    """Read a runner's stream to its end, MAX_LINE bytes at most per read: progress lines go to `on_progress`
    (parsed), the others' last lines into `tail`."""
    for raw in iter(lambda: stream.readline(MAX_LINE), b""):
        line = raw.decode("utf-8", "replace")
        p = protocol.parse_progress(line) if on_progress is not None else None
        if p is not None:
            on_progress(p)
        else:
            tail.append(line[:1000])


@dataclass
class _Child:
    proc: subprocess.Popen
    out: collections.deque
    err: collections.deque
    readers: list[threading.Thread]

    def kill(self) -> None:
        """SIGKILL the runner's whole process group (the runner and anything it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.join()

    def join(self) -> None:
        for t in self.readers:
            t.join(timeout=10)

    def why(self) -> str:
        kept = (clean_text(ln) for lines in (self.err, self.out) for ln in reversed(lines)
                if ln.strip() and protocol.parse_progress(ln) is None)
        return next((ln for ln in kept if ln), "")

    def exit_code(self, timeout: float) -> int | None:
        """The runner's exit code, None past `timeout`; the runner is killed then, and on any interrupt (Ctrl-C,
        SIGTERM): the engine is never left running."""
        try:
            code = _exited(self.proc, timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        except BaseException:
            self.kill()
            raise
        self.join()
        return code


def _exited(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for the runner to exit, leaving it unreaped (a zombie still owns its process-group id, so killing
    the group afterwards can only reach processes it started); then kill what it left, reap it, return its code."""
    end = time.monotonic() + timeout
    try:
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            time.sleep(0.05)
    except (AttributeError, ChildProcessError):    # no waitid here: wait, without the group kill
        return proc.wait(timeout=max(0.0, end - time.monotonic()))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def _spawn(argv: list[str], env: dict[str, str], on_progress: Callable[[dict[str, int]], Any] | None = None) -> _Child:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True, preexec_fn=parent_death_signal())
    out, err = collections.deque(maxlen=TAIL), collections.deque(maxlen=TAIL)
    readers = [threading.Thread(target=_pump, args=(proc.stdout, out, on_progress), daemon=True),
               threading.Thread(target=_pump, args=(proc.stderr, err, None), daemon=True)]
    for t in readers:
        t.start()
    return _Child(proc, out, err, readers)


# ------------------------------------------------------------------------------------------- folders

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process
        pass
    return True


def _processes_in(folder: Path) -> list[int]:
    """Processes (of this user; Linux /proc) whose environment names `folder` as their engine folder."""
    needle = b"\0" + f"{DIR_ENV}={folder}".encode() + b"\0"
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in b"\0" + f.read() + b"\0":
                        found.append(int(entry.name))
    return found


def sweep(root: Path | None = None) -> list[Path]:
    """Remove engine folders of kvcalib runs that no longer run (SIGKILLed: no cleanup code ran), after
    killing what still works in them. Only this user's real folders are touched. Returns what was removed."""
    root = Path(root or tempfile.gettempdir())
    pattern = re.compile(re.escape(DIR_PREFIX) + r"(\d+)-")
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            m = pattern.match(entry.name)
            if m is None or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                    continue
                path = Path(entry.path)
                for pid in _processes_in(path):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# ------------------------------------------------------------------------------------------- runs

def check(spec: EngineSpec) -> str:
    """The engine's version; EngineError (one line) when the environment cannot run it."""
    if spec.top_k < 1 or spec.kv_gib < 1:
        raise EngineError(f"--engine-top-k {spec.top_k} / --engine-kv-gib {spec.kv_gib}: both must be >= 1")
    if not spec.python.is_file():
        raise EngineError(f"--vllm-venv {spec.venv}: no bin/python there; give the virtual environment where "
                          f"{spec.name} is installed (`make engine-venv` builds one)")
    with outputs.terminate_as_interrupt():
        child = _spawn([str(spec.python), str(spec.runner), "--probe"], dict(os.environ))
        code = child.exit_code(PROBE_TIMEOUT)
    if code is None:
        raise EngineError(f"{spec.name} in {spec.venv}: `import {spec.name}` took over {PROBE_TIMEOUT:.0f} s")
    line = next((ln for ln in child.out if ln.lstrip().startswith("{")), "")
    if code != 0 or not line:
        raise EngineError(f"{spec.name} in {spec.venv} cannot run: {child.why() or f'exit code {code}'}")
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("version", "unknown"), str):
        raise EngineError(f"{spec.name} runner {spec.runner}: its --probe answer is not "
                          f'{{"engine": ..., "version": "..."}}: {clean_text(line, 120)}')
    _PROBED[(str(spec.python), str(spec.runner))] = answer.probe_formats(doc)
    return clean_text(doc.get("version", "unknown"), 80) or "unknown"


# the cache dtypes each engine environment's probe listed, kept from `check` (one probe per evaluation)
_PROBED: dict[tuple[str, str], tuple[str, ...] | None] = {}


def offered(spec: EngineSpec) -> tuple[str, ...] | None:
    """The --kv-cache-dtype values the engine in `spec` accepts, as its `check` probe listed them (None: its
    probe listed none, or it was not probed)."""
    return _PROBED.get((str(spec.python), str(spec.runner)))


def run(spec: EngineSpec, request: dict[str, Any], on_progress: Callable[[dict[str, int]], Any] | None = None,
        version: str = "") -> dict[str, Any]:
    """The runner's checked response to one engine start's request (one answer per arm); every arm not_run
    (with a one-line reason) when the runner fails or passes the deadline; EngineError when it breaks the
    protocol."""
    sweep()
    with outputs.terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix=f"{DIR_PREFIX}{os.getpid()}-") as tmp:
        req, resp = Path(tmp) / "request.json", Path(tmp) / "response.json"
        files.write_text(req, json.dumps(request))
        env = {**os.environ, DIR_ENV: str(tmp)}
        child = _spawn([str(spec.python), str(spec.runner), str(req), str(resp)], env, on_progress)
        limit = spec.timeout * max(1, len(request["arms"]))     # the deadline is per arm; a start serves several
        start = time.monotonic()
        code = child.exit_code(limit)
        if code is None:
            return protocol.not_run_all(f"timed out after {limit:.0f} s", request, spec.name, version, spec.kv_gib)
        where = f"{spec.name} runner {spec.runner}"
        if resp.is_file():
            try:
                return answer.read_response(resp, request)
            except protocol.ProtocolError as e:
                raise EngineError(f"{where} broke the protocol: {e}; its numbers cannot be used") from None
        if code == 0:
            raise EngineError(f"{where} exited 0 without writing its response{': ' + child.why() if child.why() else ''}")
        why = child.why() or "no message"
        return protocol.not_run_all(f"runner exited with code {code} after {time.monotonic() - start:.0f} s: {why}",
                                    request, spec.name, version, spec.kv_gib)
