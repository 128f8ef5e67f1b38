"""Where outputs go (calib/safety/outputs.py): --force never deletes what kvcalib did not write, no output lands on
an input, a second run into one OUT refuses, and SIGKILL at any moment leaves nothing that blocks or misleads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from calib.safety import outputs
from calib.safety.outputs import MARKER, OutputError

NAMES = st.sampled_from(["a", "b", "c.json", "d.safetensors", ".hidden"])
TREE = st.dictionaries(st.lists(NAMES, min_size=1, max_size=3).map("/".join), st.binary(max_size=8), max_size=6)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _build(root: Path, files: dict[str, bytes]) -> dict[str, bytes]:
    """Create the files (a path that would need a file as a folder is skipped); returns what was made."""
    made = {}
    for rel, data in files.items():
        p = root / rel
        if any(q.is_file() for q in [*p.parents, p]) or p.is_dir() or any(k.startswith(rel + "/") for k in made):
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        made[rel] = data
    return made


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@FAST
@given(files=TREE, listed=st.sets(st.integers(0, 5)), marker=st.booleans())
def test_force_replaces_only_folders_whose_every_file_we_wrote(tmp_path_factory, files, listed, marker):
    root = tmp_path_factory.mktemp("force")
    out = root / "out"
    out.mkdir()
    made = _build(out, files)
    names = sorted(made)
    ours = [n for i, n in enumerate(names) if i in listed]
    if marker:
        (out / MARKER).write_text(json.dumps({"producer": "kvcalib", "files": ours}))
    allowed = all(n in ours for n in names) if marker else not names
    before = _tree(out)
    try:
        with outputs.atomic_dir(out, force=True) as tmp:
            (tmp / "new.json").write_text("{}")
    except OutputError as e:
        assert not allowed and "did not write" in str(e)
        assert _tree(out) == before                                  # refused: nothing touched
    else:
        assert allowed
        assert set(_tree(out)) == {"new.json", MARKER}
        assert json.loads((out / MARKER).read_text())["files"] == ["new.json"]
    assert sorted(p.name for p in root.iterdir()) == ["out"]        # no temp folder, no lock file


PATHS = st.lists(st.sampled_from(["x", "y", "z"]), min_size=1, max_size=3).map(tuple)


@FAST
@given(out=PATHS, inp=PATHS, inp_is_dir=st.booleans(), force=st.booleans())
def test_no_output_is_contains_or_lies_inside_an_input(tmp_path_factory, out, inp, inp_is_dir, force):
    root = tmp_path_factory.mktemp("rel")
    src = root.joinpath(*inp)
    if inp_is_dir:
        src.mkdir(parents=True)
        (src / "config.json").write_text("{}")
    else:
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text("data")
    target = root.joinpath(*out)
    related = target == src or src.is_relative_to(target) or (inp_is_dir and target.is_relative_to(src))
    before = _tree(root)
    try:
        outputs.check_folder(target, force=force, inputs=[("the model folder", src)])
    except OutputError as e:
        msg = str(e)
        assert related or "is a file" in msg or "already exists" in msg or "did not write" in msg, msg
        if related:
            assert "the model folder" in msg
    else:
        assert not related
    assert _tree(root) == before


@FAST
@given(data=st.binary(max_size=64))
def test_only_our_statistics_files_are_recognised(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("stats")
    foreign = root / "f.safetensors"
    foreign.write_bytes(data)
    assert not outputs.is_statistics_file(foreign)
    with pytest.raises(OutputError, match="did not write"):
        outputs.check_file(foreign, option="--stats-out", force=True)
    assert foreign.read_bytes() == data


def test_statistics_files_are_replaced_only_with_force(tmp_path):
    ours, weights = tmp_path / "s.safetensors", tmp_path / "w.safetensors"
    save_file({"x": torch.zeros(2)}, str(ours), metadata={"kvcalib": "{}"})
    save_file({"x": torch.zeros(2)}, str(weights), metadata={"format": "pt"})
    assert outputs.is_statistics_file(ours) and not outputs.is_statistics_file(weights)
    with pytest.raises(OutputError, match="already exists; pass --force"):
        outputs.check_file(ours, option="--stats-out")
    outputs.check_file(ours, option="--stats-out", force=True)
    outputs.check_file(ours, option="--checkpoint-every", force=None)       # the resume file: ours is replaced
    with pytest.raises(OutputError, match="did not write"):
        outputs.check_file(weights, option="--stats-out", force=True)


def test_current_folder_and_its_ancestors_are_never_outputs(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for out, why in ((".", "is the current folder"), ("..", "holds the current folder"),
                     (str(tmp_path), "holds the current folder")):
        with pytest.raises(OutputError, match=why):
            outputs.check_folder(Path(out), force=True)


def test_second_lock_refuses_at_once_and_names_the_holder(tmp_path):
    import fcntl

    out = tmp_path / "new" / "deeper" / "out"
    with outputs.lock(out):
        lock = outputs.lock_path(out)
        assert lock.read_text().strip() == str(os.getpid())
        with outputs.lock(out):        # re-entrant in this process
            pass
        fd = os.open(lock, os.O_RDWR)   # another open file description: what another process would hold
        try:
            with pytest.raises(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not (tmp_path / "new").exists()   # the lock file and the folders made for it are gone
    fd = os.open(tmp_path / ".o.kvcalib-lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"777\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(OutputError, match=r"another kvcalib run \(pid 777\) is writing"):
            with outputs.lock(tmp_path / "o"):
                pass
    finally:
        os.close(fd)


def test_leftovers_of_dead_runs_are_cleaned_and_a_moved_aside_output_restored(tmp_path):
    out = tmp_path / "ckpt"
    old = tmp_path / ".ckpt.kvcalib-old-99999"
    old.mkdir()
    (old / "config.json").write_text("previous")
    for name in (".ckpt.kvcalib-tmp-99998", ".ckpt.kvcalib-tmp-99999"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "big").write_bytes(b"0" * 1000)
    (tmp_path / ".other.kvcalib-tmp-1").mkdir()   # another output's: not ours to judge
    with outputs.lock(out):
        pass
    assert (out / "config.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.kvcalib-tmp-1", "ckpt"]
    old.mkdir()                                     # OUT exists now: a stale moved-aside copy is removed
    with outputs.lock(out):
        pass
    assert not old.exists() and (out / "config.json").read_text() == "previous"


KILLED = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from calib.safety import outputs
    out, stage = Path(sys.argv[1]), sys.argv[2]
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        if stage == "between-renames" and ".kvcalib-old-" in str(b):
            print("READY", flush=True); time.sleep(60)
    outputs.os.rename = rename
    with outputs.atomic_dir(out, force=True) as tmp:
        (tmp / "config.json").write_text("new")
        (tmp / "weights").write_bytes(b"0" * 100000)
        if stage == "writing":
            print("READY", flush=True); time.sleep(60)
""")


@pytest.mark.parametrize("stage", ["writing", "between-renames"])
def test_sigkill_at_any_stage_leaves_nothing_that_blocks(tmp_path, stage):
    out = tmp_path / "ckpt"
    with outputs.atomic_dir(out, force=False) as tmp:
        (tmp / "config.json").write_text("previous")
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(out), stage], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    debris = sorted(p.name for p in tmp_path.iterdir() if p.name != "ckpt")
    assert debris and all(".ckpt.kvcalib-" in d for d in debris)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # the next run finds the previous output where it was, replaces it, and leaves nothing else
    with outputs.lock(out):
        assert (out / "config.json").read_text() == "previous"
    with outputs.atomic_dir(out, force=True) as tmp:
        (tmp / "config.json").write_text("next")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (out / "config.json").read_text() == "next"


def test_room_is_checked_before_writing(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    with pytest.raises(OutputError, match="GiB free but the output needs"):
        outputs.check_room(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=150, deadline=None)
@given(name=st.one_of(st.text(max_size=12), st.sampled_from(["cpu", "cuda", "cuda:1", "mps", "meta", "cpu:0", ""])))
def test_any_device_string_is_accepted_or_refused_in_one_line(name):
    from calib.safety import options

    try:
        options.device(name)
    except options.OptionError as e:
        assert "\n" not in str(e) and str(e).startswith("--device")
    else:
        assert name.startswith("cpu") or (name.startswith("cuda") and torch.cuda.is_available())


@settings(max_examples=80, deadline=None)
@given(value=st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=3)))
def test_numeric_options_accept_exactly_the_valid_values(value):
    from calib.safety import options

    ok_whole = value is None or (type(value) is int and value >= 1)
    try:
        options.whole("--samples", value)
        assert ok_whole
    except options.OptionError as e:
        assert not ok_whole and str(e).startswith("--samples")
    ok_number = value is None or (type(value) in (int, float) and value == value and abs(value) != float("inf")
                                  and value >= 0)
    try:
        options.number("--max-kl", value)
        assert ok_number
    except options.OptionError:
        assert not ok_number


# ------------------------------------------------------------------------------------------- whole runs

def _cli(*args, cwd=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "calib.cli", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _calibrate_args(model: Path, data: Path, out: Path) -> list:
    return ["calibrate", "--model", model, "--data", data, "--out", out, "--seq-len", "32", "--samples", "8",
            "--device", "cpu"]


def test_merge_force_replaces_only_its_own_file(tiny_llama_dir, token_data, tmp_path):
    from click.testing import CliRunner

    from calib.cli import main

    stats = []
    for name in ("a", "b"):
        r = CliRunner().invoke(main, [*map(str, _calibrate_args(tiny_llama_dir, token_data, tmp_path / name)),
                                      "--target", "", "--stats-out", str(tmp_path / f"{name}.safetensors")])
        assert r.exit_code == 0, r.output
        stats.append(str(tmp_path / f"{name}.safetensors"))
    out = tmp_path / "both.safetensors"
    assert CliRunner().invoke(main, ["merge", *stats, "--out", str(out)]).exit_code == 0
    r = CliRunner().invoke(main, ["merge", *stats, "--out", str(out)])
    assert r.exit_code == 1 and "already exists; pass --force" in r.output
    r = CliRunner().invoke(main, ["merge", *stats, "--out", str(out), "--force"])
    assert r.exit_code == 0 and outputs.is_statistics_file(out)
    assert not list(tmp_path.glob(".*kvcalib-*"))


def test_a_run_clears_what_dead_runs_left_beside_its_outputs(tiny_llama_dir, token_data, tmp_path):
    from click.testing import CliRunner

    from calib.cli import main

    runs = tmp_path / "runs"
    runs.mkdir()
    for junk in (".ckpt.kvcalib-tmp-99999", ".ckpt.kvcalib-old-99998"):
        (runs / junk).mkdir()
        (runs / junk / "model.safetensors").write_bytes(b"0" * 4096)
        outputs.write_marker(runs / junk, "checkpoint")
    (runs / ".ckpt.kvcalib-lock").write_text("99999\n")          # a dead run's lock file does not block
    (runs / ".ckpt.kvcalib-resume.safetensors.kvcalib-tmp-99999").write_bytes(b"half a save")
    args = [*map(str, _calibrate_args(tiny_llama_dir, token_data, runs / "ckpt"))]
    # the dead run had moved the previous output aside: it is put back, so OUT exists again
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "already exists; pass --force" in r.output and "calibrating" not in r.output
    assert (runs / "ckpt" / "model.safetensors").read_bytes() == b"0" * 4096
    r = CliRunner().invoke(main, [*args, "--force"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in runs.iterdir()) == ["ckpt"]
    assert outputs.foreign_files(runs / "ckpt") == [] and (runs / "ckpt" / "kv_scales.safetensors").is_file()


def test_disk_full_mid_write_is_one_line_and_leaves_nothing(tiny_llama_dir, token_data, tmp_path, monkeypatch):
    import errno

    import safetensors.torch
    from click.testing import CliRunner

    from calib.cli import main

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(safetensors.torch, "save", full)          # small files are serialized in memory first
    out = tmp_path / "runs" / "ckpt"
    r = CliRunner().invoke(main, [*map(str, _calibrate_args(tiny_llama_dir, token_data, out))])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == 1 and isinstance(r.exception, (SystemExit, type(None))), r.exception
    assert len(errors) == 1 and "writing failed (No space left on device); nothing was written" in errors[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_sigkill_mid_calibration_then_the_next_run_succeeds(tiny_llama_dir, token_data, tmp_path):
    slow = textwrap.dedent("""
        import sys, time
        import calib.export.write as ex
        orig = ex.link_or_copy
        def slow(*a, **k):
            print("STAGE-REACHED", flush=True); time.sleep(60); return orig(*a, **k)
        ex.link_or_copy = slow
        from calib.cli import main
        sys.argv = ["kvcalib", *sys.argv[1:]]
        main()
    """)
    out = tmp_path / "o" / "ckpt"
    args = _calibrate_args(tiny_llama_dir, token_data, out)
    proc = subprocess.Popen([sys.executable, "-c", slow, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "STAGE-REACHED" in line:
            break
    # meanwhile a second run into the same OUT refuses with one line
    second = _cli(*args)
    text, _ = second.communicate(timeout=120)
    assert second.returncode == 1 and "another kvcalib run" in text and "Traceback" not in text, text
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert list((tmp_path / "o").glob(".ckpt.kvcalib-*"))          # the dead run's temp folder and lock file
    third = _cli(*args)
    text, _ = third.communicate(timeout=300)
    assert third.returncode == 0, text
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["ckpt"]
    assert (out / MARKER).is_file() and outputs.foreign_files(out) == []


@pytest.mark.slow
def test_sigkill_at_random_moments(tiny_llama_dir, token_data, tmp_path):
    """Kill a real run at several moments (loading, calibrating, exporting, replacing): every next run succeeds
    and afterwards nothing but OUT is left."""
    out = tmp_path / "o" / "ckpt"
    args = [*_calibrate_args(tiny_llama_dir, token_data, out), "--force"]
    assert _cli(*args).wait(timeout=300) == 0
    for delay in (0.5, 3.0, 5.0, 6.5, 8.0):
        proc = _cli(*args)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        leftovers = [p.name for p in (tmp_path / "o").iterdir() if p.name != "ckpt"]
        assert all(".ckpt.kvcalib-" in n for n in leftovers), leftovers
        nxt = _cli(*args)
        text, _ = nxt.communicate(timeout=300)
        assert nxt.returncode == 0, text
        assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["ckpt"]
        assert outputs.foreign_files(out) == []


@pytest.mark.slow
def test_two_runs_into_one_out_never_both_write(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "ckpt"
    procs = [_cli(*_calibrate_args(tiny_llama_dir, token_data, out)) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    refused = next(text for code, text in results if code == 1)
    assert "Traceback" not in refused
    assert "another kvcalib run" in refused or "already exists" in refused, refused
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_error_while_filling_the_temporary_folder_names_the_users_out(tmp_path, monkeypatch):
    """A command nested in another (a plan's route evaluation, a multi-target checkpoint's variants) checks and
    writes inside kvcalib's temporary folder: its errors name the user's --out, which is what the user can act on."""
    monkeypatch.chdir(tmp_path)
    out = Path("plans") / "p"
    with pytest.raises(outputs.OutputError) as e:
        with outputs.atomic_dir(out, False) as tmp:
            outputs.check_folder(tmp / "chat", force=False, inputs=[("the data", tmp / "chat")])
    assert str(e.value) == f"--out {out}/chat is the data ({out}/chat); choose a new path"
    assert ".kvcalib-tmp-" not in str(e.value) and not out.exists()
    with pytest.raises(outputs.OutputError) as e:
        with outputs.atomic_file(tmp_path / "s.safetensors", "--stats-out") as tmp:
            raise outputs.OutputError(f"--stats-out {tmp}: bad")
    assert str(e.value) == f"--stats-out {tmp_path / 's.safetensors'}: bad"
