"""A `vllm serve` started by kvcalib dies with its engine process however kvcalib ends — SIGTERM included.

Measured on an H100: `timeout` sent SIGTERM to a sweep, Python died without running its cleanup, the
parent-death signal killed the server's own process, and the engine process under it kept ~37 GiB of the GPU;
the next arm's server then failed at start-up. The fake server here starts a child the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from calib.load import server

FAKE_CLI = Path(__file__).resolve().parents[1] / "fake_vllm_cli.py"
VENV = Path(sys.executable).parent.parent

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from calib.load import server
    with server.serving(Path(sys.argv[1]), server.ServeConfig("m"), server.Launch(64, 1, on_cpu=True),
                        Path(sys.argv[2])) as srv:
        print("up", flush=True)
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                          # a zombie has exited; only its entry is left
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_engine_process_under_the_server_dies_when_kvcalib_is_terminated(tmp_path, sig):
    pidfile = tmp_path / "engine.pid"
    env = {**os.environ, server.CLI_ENV: str(FAKE_CLI), "FAKE_ENGINE_PID": str(pidfile)}
    # SIGINT at its default in the child: a job started in the background (CI's runner may be one) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(VENV), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "up", proc.stderr.read()
        engine = int(pidfile.read_text())
        assert _alive(engine)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(engine), f"the engine process {engine} outlived kvcalib after {sig.name}"
    finally:
        proc.kill()
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
