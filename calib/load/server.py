"""vLLM's own OpenAI-compatible server and its own load generator, run from the engine's environment.

Why the real server and not a loop over the offline API: users deploy `vllm serve` — its scheduler, continuous
batching and default execution (CUDA graphs; eager measured 3.2x slower at saturation, docs/design.md §12) — and
the ecosystem measures it with `vllm bench serve`. Both run here as the user would run them, from the engine's
virtual environment; kvcalib only chooses the command lines, watches the server's own metrics while the load
runs, and reads what they wrote.

The server runs in its own process group with a parent-death signal (calib.engine.driver), its log goes to a file
in kvcalib's temporary folder (kept: the last lines explain a failure in one line), and it is killed with its
group when the block ends, however it ends — SIGTERM included: Python's default SIGTERM ends the process
without running `finally` blocks, and the parent-death signal reaches only the server's own process, not the
engine process vLLM starts under it, which then kept ~37 GiB of a GPU after a `timeout` (measured on an H100).
So while a server runs, SIGTERM unwinds like Ctrl-C (calib.safety.outputs.terminate_as_interrupt) whoever
calls this module: the CLI sets it too, a script such as bench/gpu/serve_sweep.py did not.

Its capacity is the engine's own: the line vLLM logs at start-up
("KV cache size: N tokens" and "Maximum concurrency for L tokens per request: X"), at max_model_len = this
bucket's longest request, so it counts the KV cache groups, page padding and sliding-window reservations exactly
as the scheduler does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calib.engine import command
from calib.engine.driver import parent_death_signal
from calib.errors import KvcalibError
from calib.safety import outputs

LOG_TAIL = 64 << 10                     # bytes of the server's log read back to explain a failure
POLL_S = 0.5
WATCHED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total", "vllm:num_preemptions")
_SIZE = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")
_CONC = re.compile(r"Maximum concurrency for\s*([\d,]+)\s*tokens per request:\s*([\d.]+)x")
_METRIC = re.compile(r"^(vllm:[A-Za-z_:]+)(\{[^}]*\})?\s+(\S+)$")


class ServerError(KvcalibError, RuntimeError):
    """The server did not start or died; the message carries its last log line."""


@dataclass(frozen=True)
class ServeConfig:
    """What the engine fixes at start-up for one arm's speed: the model folder, the KV cache dtype, the layers kept
    in the model dtype (indices and vLLM's layer-kind names such as "sliding_window"), an attention backend where
    the format needs one."""
    model: str
    kv_cache_dtype: str = "auto"
    skip_layers: tuple[int | str, ...] = ()
    attention_backend: str | None = None

    def flags(self) -> list[str]:
        """The serve flags that make this configuration (the ones a user copies)."""
        return command.spelled("vllm", None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
                               self.skip_layers, self.attention_backend)

    def command(self) -> str:
        return shlex.join(command.argv("vllm", self.model) + self.flags())


@dataclass(frozen=True)
class Launch:
    """How one server start is sized: the longest request it must hold, the KV pool, the model dtype."""
    max_model_len: int
    kv_gib: int
    dtype: str = "auto"
    max_num_seqs: int | None = None      # None: the engine's default, as users serve
    prefix_caching: bool = False
    on_cpu: bool = False
    timeout: float = 1800.0


CLI = Path(__file__).resolve().parent / "vllm_cli.py"
CLI_ENV = "KVCALIB_VLLM_CLI"          # another script answering `serve` and `bench serve` (the tests' fake server)


def cli(venv: Path) -> list[str]:
    """vLLM's command line in the engine's environment (calib/load/vllm_cli.py says why not `bin/vllm`)."""
    return [str(Path(venv) / "bin" / "python"), os.environ.get(CLI_ENV) or str(CLI)]


def argv(venv: Path, cfg: ServeConfig, launch: Launch, port: int) -> list[str]:
    """The `vllm serve` command line. The KV pool is fixed in bytes on a GPU (`--kv-cache-memory-bytes`) and by
    VLLM_CPU_KVCACHE_SPACE on a CPU (`env`), so every arm gets the same pool whatever its weights take."""
    out = [*cli(venv), "serve", cfg.model, *cfg.flags(), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(launch.max_model_len), "--dtype", launch.dtype,
           "--seed", "0", "--served-model-name", "kvcalib-arm",
           "--enable-prefix-caching" if launch.prefix_caching else "--no-enable-prefix-caching"]
    if launch.max_num_seqs:
        out += ["--max-num-seqs", str(launch.max_num_seqs)]
    if not launch.on_cpu:
        out += ["--kv-cache-memory-bytes", str(launch.kv_gib << 30)]
    return out


def env(launch: Launch, folder: Path) -> dict[str, str]:
    e = {**os.environ, "KVCALIB_ENGINE_DIR": str(folder)}
    if launch.on_cpu:
        e["VLLM_CPU_KVCACHE_SPACE"] = str(launch.kv_gib)
    return e


def capacity(log: str) -> dict[str, Any]:
    """The engine's own KV capacity from its start-up log: pool size in tokens, and the requests of
    max_model_len it holds at once (the concurrency it logs, and its whole part: requests that fit)."""
    size, conc = _SIZE.findall(log), _CONC.findall(log)
    out: dict[str, Any] = {"kv_cache_tokens": int(size[-1].replace(",", "")) if size else None,
                           "max_model_len": None, "max_concurrency": None, "requests_fit": None}
    if conc:
        length, x = conc[-1]
        out.update(max_model_len=int(length.replace(",", "")), max_concurrency=float(x), requests_fit=int(float(x)))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """The watched `vllm:` gauges and counters from a Prometheus text page, summed over label sets
    (one engine here: the sum is its value)."""
    out: dict[str, float] = {}
    for line in text.splitlines()[:20000]:
        m = _METRIC.match(line.strip())
        if m and m.group(1) in WATCHED:
            with contextlib.suppress(ValueError):
                v = float(m.group(3))
                if v == v and abs(v) != float("inf"):
                    out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def cache_info(text: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (block size, blocks, cache dtype) from a metrics page."""
    for line in text.splitlines()[:20000]:
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0])[:64])
    return {}


@dataclass
class Watch:
    """The server's own numbers sampled while one load level runs: the most requests running and waiting, the
    highest KV-cache usage, preemptions over the level, the peak memory seen (GPU memory used, or the server's
    resident memory on a CPU)."""
    max_running: float | None = None
    max_waiting: float | None = None
    max_kv_usage: float | None = None
    preemptions: float | None = None
    peak_memory_bytes: int | None = None
    samples: int = 0


def _hi(a: float | None, b: float | None) -> float | None:
    return b if a is None else (a if b is None else max(a, b))


@dataclass
class Server:
    venv: Path
    cfg: ServeConfig
    launch: Launch
    folder: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    started_s: float | None = None
    capacity: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, size: int = LOG_TAIL) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - size))
            return f.read().decode("utf-8", "replace")

    def why(self) -> str:
        lines = [ln.strip() for ln in self.log_tail().splitlines() if ln.strip()]
        errs = [ln for ln in lines if re.search(r"Error|error:|exception|Traceback", ln)]
        line = (errs or lines or ["no output"])[-1]
        return " ".join("".join(c if c.isprintable() else " " for c in line[:300]).split())

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read(4 << 20).decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, ""
        except (urllib.error.URLError, OSError, TimeoutError):
            return 0, ""

    def start(self) -> None:
        if not self.port:
            with socket.socket() as s:      # a free port
                s.bind(("127.0.0.1", 0))
                self.port = int(s.getsockname()[1])
        self.log_path = self.folder / f"server-{self.port}.log"
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv(self.venv, self.cfg, self.launch, self.port), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env(self.launch, self.folder),
                                         start_new_session=True, preexec_fn=parent_death_signal())
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"`{self.cfg.command()}` exited with code {self.proc.returncode} at start-up: "
                                  f"{self.why()}")
            if time.monotonic() - t0 > self.launch.timeout:
                raise ServerError(f"`{self.cfg.command()}` was not ready after {self.launch.timeout:.0f} s: {self.why()}")
            if self.get("/health", timeout=2.0)[0] == 200:
                break
            time.sleep(1.0)
        self.started_s = time.monotonic() - t0
        self.capacity = capacity(self.log_tail(8 << 20))
        self.cache = cache_info(self.get("/metrics")[1])

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)

    def memory(self) -> int | None:
        """GPU memory in use (the whole device: kvcalib's server is its only user), or the resident memory of the
        server's process group on a CPU."""
        if not self.launch.on_cpu:
            smi = shutil.which("nvidia-smi")
            if not smi:
                return None
            try:
                out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split()
                return int(float(out[0])) << 20 if out else None
            except (OSError, ValueError, subprocess.SubprocessError):
                return None
        return _group_rss(self.proc.pid) if self.proc else None

    @contextlib.contextmanager
    def watching(self) -> Iterator[Watch]:
        """Sample the server's metrics (and memory) every POLL_S seconds while the block runs."""
        w, stop = Watch(), threading.Event()
        first = parse_metrics(self.get("/metrics")[1])

        def preempted(m: dict[str, float]) -> float | None:
            for k in ("vllm:num_preemptions_total", "vllm:num_preemptions"):
                if k in m and k in first:
                    return m[k] - first[k]
            return None

        def loop() -> None:
            while not stop.is_set():
                m = parse_metrics(self.get("/metrics", timeout=2.0)[1])
                if m:
                    w.samples += 1
                    w.max_running = _hi(w.max_running, m.get("vllm:num_requests_running"))
                    w.max_waiting = _hi(w.max_waiting, m.get("vllm:num_requests_waiting"))
                    w.max_kv_usage = _hi(w.max_kv_usage, m.get("vllm:kv_cache_usage_perc",
                                                             m.get("vllm:gpu_cache_usage_perc")))
                    w.preemptions = _hi(w.preemptions, preempted(m))
                w.peak_memory_bytes = _hi(w.peak_memory_bytes, self.memory())
                stop.wait(POLL_S)
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            yield w
        finally:
            stop.set()
            t.join(timeout=10)
            last = preempted(parse_metrics(self.get("/metrics")[1]))
            w.preemptions = _hi(w.preemptions, last)


def _group_rss(pgid: int) -> int | None:
    """Resident bytes of every process in the process group `pgid` (Linux /proc), None elsewhere."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for e in entries:
        if not e.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:                     # field 5 of stat: the process group
                total += int(Path(f"/proc/{e}/statm").read_text().split()[1]) * page
    return total or None


@contextlib.contextmanager
def serving(venv: Path, cfg: ServeConfig, launch: Launch, folder: Path) -> Iterator[Server]:
    """A started server for `cfg`, stopped with its process group when the block ends (errors, interrupts and
    SIGTERM included)."""
    srv = Server(Path(venv), cfg, launch, folder)
    with outputs.terminate_as_interrupt():
        try:
            srv.start()
            yield srv
        finally:
            srv.stop()


def bench_argv(venv: Path, srv: Server, dataset: Path, n: int, level: int, result: Path, tokenizer: str,
               slo_ttft_ms: float, slo_tpot_ms: float) -> list[str]:
    """`vllm bench serve` for one level: `n` requests from `dataset` (one JSON line each: prompt text and its
    output tokens), `level` in flight, all sent at once (request rate inf), every request detailed in `result`."""
    return [*cli(venv), "bench", "serve", "--backend", "vllm", "--base-url", srv.url,
            "--endpoint", "/v1/completions", "--model", "kvcalib-arm", "--tokenizer", tokenizer,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n), "--max-concurrency", str(level),
            "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--goodput", f"ttft:{slo_ttft_ms:g}", f"tpot:{slo_tpot_ms:g}",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
            "--disable-tqdm"]


def run_bench(cmd: Sequence[str], folder: Path, timeout: float) -> tuple[int, str]:
    """Run one load level to its end in its own process group: (exit code, the last lines of its output). On a
    deadline (subprocess.TimeoutExpired) or an interrupt the group is killed and the exception goes on."""
    log = folder / f"bench-{time.monotonic_ns()}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "KVCALIB_ENGINE_DIR": str(folder)}, start_new_session=True,
                                preexec_fn=parent_death_signal())
    try:
        code = proc.wait(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return code, log.read_bytes()[-LOG_TAIL:].decode("utf-8", "replace")
