"""The installed wheel, not the checkout: recipes and sample data travel with it and work from any folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_code_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "calib").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built as a wheel and unpacked into a folder of its own (deps come from the test venv)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp.glob("kvcalib-*.whl"))
    target = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return target


def _kvcalib(site: Path, cwd: Path, *args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(home)}
    env.pop("KVCALIB_HOME", None)
    code = ("import sys, calib, calib.cli; assert calib.__file__.startswith(sys.argv[1]), calib.__file__; "
            "sys.argv = ['kvcalib', *sys.argv[2:]]; calib.cli.main()")
    return subprocess.run([sys.executable, "-c", code, str(site), *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_wheel_carries_recipes_and_sample_data(installed):
    assert {p.name for p in (installed / "calib" / "recipes").glob("*.yaml")} == \
        {p.name for p in (ROOT / "recipes").glob("*.yaml")}
    assert (installed / "calib" / "sample_data" / "sample_text.jsonl").read_bytes() == \
        (ROOT / "data" / "sample_text.jsonl").read_bytes()


def test_installed_cli_runs_from_another_folder(installed, tmp_path, tiny_llama_dir, token_data):
    from calib import __version__

    r = _kvcalib(installed, tmp_path, "--version", home=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"kvcalib {__version__}", r.stderr
    r = _kvcalib(installed, tmp_path, "recipes", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^fp8-head\s", r.stdout, re.M)
    r = _kvcalib(installed, tmp_path, "recipes", "show", "fp8-head", home=tmp_path)
    assert r.returncode == 0 and 'granularity: "head"' in r.stdout, r.stdout + r.stderr
    r = _kvcalib(installed, tmp_path, "calibrate", "--model", str(tiny_llama_dir), "--data", str(token_data),
                 "--recipe", "fp8-head", "--out", "ckpt", "--samples", "4", "--seq-len", "64", "--device", "cpu", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "kv_scales.safetensors").is_file()


def test_resources_follow_kvcalib_home(tmp_path, monkeypatch):
    from calib import resources

    monkeypatch.setenv("KVCALIB_HOME", str(tmp_path))
    monkeypatch.delenv("KVCALIB_CACHE", raising=False)
    assert resources.recipes_dir() == tmp_path / "recipes"
    assert resources.default_data() == tmp_path / "data" / "sample_text.jsonl"
    assert resources.build_dir() == tmp_path / "build"
    monkeypatch.delenv("KVCALIB_HOME")
    assert resources.recipes_dir() == ROOT / "recipes" and resources.build_dir() == ROOT / "build"
