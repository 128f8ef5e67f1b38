"""Nothing is written through a link (calib/safety/files.py and its callers): a link, a second hard link or a
FIFO planted where kvcalib creates a file is a one-line error naming it, and the file it points to is unchanged;
a write that hits a file-size limit is one line with nothing left behind."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from calib.safety import files, outputs

REPO = Path(__file__).resolve().parents[2]


def _user_file(tmp_path: Path) -> Path:
    f = tmp_path / "thesis.txt"
    f.write_text("years of work\n")
    return f


# ------------------------------------------------------------------------------------------- the helper

def test_create_refuses_a_link_and_anything_already_there(tmp_path):
    target = _user_file(tmp_path)
    link = tmp_path / "new.json"
    link.symlink_to(target)
    with pytest.raises(files.LinkError, match=f"{link} is a symbolic link where kvcalib writes"):
        files.write_text(link, "{}")
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(files.LinkError, match="is a symbolic link"):
        files.write_bytes(dangling, b"x")
    with pytest.raises(files.LinkError, match="already exists where kvcalib creates a new file"):
        files.write_text(target, "{}")
    assert target.read_text() == "years of work\n" and not (tmp_path / "would-be-created").exists()
    with pytest.raises(files.LinkError, match="is a symbolic link"):
        files.make_dir(link)


def test_save_tensors_in_memory_and_through_a_private_folder_give_the_same_file(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    files.save_tensors(tmp_path / "small.safetensors", t, {"k": "v"})
    monkeypatch.setattr(files, "IN_MEMORY", 0)
    files.save_tensors(tmp_path / "large.safetensors", t, {"k": "v"})
    assert (tmp_path / "small.safetensors").read_bytes() == (tmp_path / "large.safetensors").read_bytes()
    assert torch.equal(load_file(tmp_path / "large.safetensors")["a"], t["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["large.safetensors", "small.safetensors"]
    link = tmp_path / "link.safetensors"
    link.symlink_to(tmp_path / "small.safetensors")
    for limit in (0, 1 << 30):
        monkeypatch.setattr(files, "IN_MEMORY", limit)
        with pytest.raises(files.LinkError, match="is a symbolic link"):
            files.save_tensors(link, t)


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_lock_path_that_is_not_our_own_file_is_refused(tmp_path, plant):
    target = _user_file(tmp_path)
    out = tmp_path / "out"
    lock = outputs.lock_path(out)
    if plant == "symlink":
        lock.symlink_to(target)
    elif plant == "hardlink":
        os.link(target, lock)
    else:
        os.mkfifo(lock)
    with pytest.raises(outputs.OutputError) as e:
        with outputs.lock(out):
            pass
    assert str(lock) in str(e.value) and "\n" not in str(e.value)
    assert target.read_text() == "years of work\n"
    assert lock.is_symlink() or lock.exists()          # left as it was: kvcalib removes only its own files


# ------------------------------------------------------------------------------------------- commands

def _stats(tmp_path: Path, name: str) -> Path:
    from calib.capture.hook import KVCapture
    from calib.capture import statsfile
    from calib.capture.spec import capture_spec
    from calib.recipe.recipe import Recipe

    cap = KVCapture([0, 1], capture_spec(Recipe(), rotary_dim=16))
    g = torch.Generator().manual_seed(0)
    for i in (0, 1):
        cap.record(i, *(torch.randn(1, h, 4, 16, generator=g) for h in (4, 2, 2)))
    return statsfile.save(tmp_path / name, cap, {"producer": "kvcalib", "model_config_sha256": "sha256:x",
                                                  "rotary_dim": 16, "recipe": Recipe().to_dict(), "data": {}})


def test_calibrate_and_merge_never_write_through_a_planted_lock_link(tiny_llama_dir, token_data, tmp_path):
    target = _user_file(tmp_path)
    (tmp_path / ".out.kvcalib-lock").symlink_to(target)
    r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_llama_dir), "--data", str(token_data), "--seq-len",
                                  "32", "--samples", "8", "--device", "cpu", "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and ".out.kvcalib-lock is a symbolic link where kvcalib writes" in r.output, r.output
    a, b = _stats(tmp_path, "a.safetensors"), _stats(tmp_path, "b.safetensors")
    (tmp_path / ".m.safetensors.kvcalib-lock").symlink_to(target)
    r = CliRunner().invoke(main, ["merge", str(a), str(b), "--out", str(tmp_path / "m.safetensors")])
    assert r.exit_code == 1 and ".m.safetensors.kvcalib-lock is a symbolic link where kvcalib writes" in r.output
    assert target.read_text() == "years of work\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.safetensors").exists()


def _limited(limit: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a process whose files may not grow past `limit` bytes (RLIMIT_FSIZE: a full disk, exactly)."""
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return subprocess.run([sys.executable, "-m", "calib.cli", *args], cwd=cwd, preexec_fn=preexec, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_file_size_limit_during_merge_export_and_calibrate_is_one_line_and_leaves_nothing(tiny_llama_dir,
                                                                                            token_data, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    a, b = _stats(tmp_path, "a.safetensors"), _stats(tmp_path, "b.safetensors")
    r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_llama_dir), "--data", str(token_data), "--seq-len",
                                  "32", "--samples", "8", "--device", "cpu", "--target", "", "--out",
                                  str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    cases = [["merge", str(a), str(b), "--out", str(runs / "m.safetensors")],
             ["export", "--stats", str(tmp_path / "st" / "stats.safetensors"), "--model", str(tiny_llama_dir),
              "--out", str(runs / "ckpt")],
             ["calibrate", "--model", str(tiny_llama_dir), "--data", str(token_data), "--seq-len", "32", "--samples",
              "8", "--device", "cpu", "--out", str(runs / "cal"), "--stats-out", str(runs / "s.safetensors")]]
    for args in cases:
        r = _limited(1000, args, tmp_path)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert len(errors) == 1 and "writing failed (File too large); nothing was written" in errors[0], r.stderr
        assert list(runs.iterdir()) == [], args[0]
