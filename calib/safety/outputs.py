"""Where outputs go: the one module that decides whether kvcalib may write, replace or lock a path.

Why it exists: an output option is the one place where a typo destroys data. `--out proj --force` must not
delete the project the model lives in; `--stats-out MODEL/model.safetensors` must not overwrite weights; two
runs into one OUT must not silently replace each other; a run killed with SIGKILL (where no cleanup code
runs) must leave nothing that blocks, misleads or fills the disk. The rules, all enforced here:

- Folder outputs (a checkpoint, a statistics-only output, an eval report) are built in a temporary sibling
  `.NAME.kvcalib-tmp-PID` and renamed into place when complete. Every folder kvcalib writes carries a marker
  file (`.kvcalib-output.json`) listing the files it wrote. `--force` replaces a folder only when it is empty
  or carries our marker and holds nothing the marker does not list.
- No output is, contains, or lies inside an input (the model, the data, the recipe, a checkpoint read for
  scales, a statistics file), and no folder output is the current folder or one of its ancestors.
- Single-file outputs (statistics files, the resume file) never replace a file kvcalib did not write:
  ours are recognised by content (the `kvcalib` header of a safetensors statistics file).
- Every output path is locked (`.NAME.kvcalib-lock` beside it, flock'd: the kernel releases it when the
  process dies, however it dies). The lock holder owns every `.NAME.kvcalib-tmp-*` / `.NAME.kvcalib-old-*`
  beside it: any it finds are leftovers of a dead run, so they are removed (a previous output a dead run had
  moved aside is put back first).
- Paths are checked writable, and the filesystem for room, before any model is loaded.
- Nothing is written through a link: every file and folder kvcalib creates goes through `safety.files`
  (O_EXCL | O_NOFOLLOW), the lock file is opened without following links and checked on its descriptor, and
  a link found where kvcalib writes is a one-line error naming it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from calib.errors import KvcalibError
from calib.safety import files

MARKER = ".kvcalib-output.json"
TMP_TAG = ".kvcalib-tmp-"
OLD_TAG = ".kvcalib-old-"
LOCK_TAG = ".kvcalib-lock"
_MAX_HEADER = 100 << 20          # a safetensors header larger than this is not one of our statistics files

Inputs = Iterable[tuple[str, "str | Path | None"]]   # (what it is, path) — e.g. ("the model", "m/")


class OutputError(KvcalibError, ValueError):
    """An output path cannot be written as asked; nothing was written or removed."""


# ------------------------------------------------------------------------------------------- names

def tmp_path(out: Path, pid: int | None = None) -> Path:
    return out.parent / f".{out.name}{TMP_TAG}{os.getpid() if pid is None else pid}"


def resume_path(out: Path) -> Path:
    """Where a calibration into `out` saves its observers (`--checkpoint-every`) for `--resume`."""
    return Path(out).parent / f"{Path(out).name}.kvcalib-resume.safetensors"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_TAG}"


def _abs(p: str | Path, what: str = "") -> Path:
    return Path(os.path.abspath(files.expand_user(p, what)))


def _real(p: str | Path, what: str = "") -> Path:
    return files.expand_user(p, what).resolve()


# ------------------------------------------------------------------------------------------- checks

def _check_place(path: Path, inputs: Inputs, option: str, *, folder: bool) -> None:
    """`path` must not be an input, contain one (folder outputs), or lie inside one that is not a file (an input
    that does not exist yet, another output, still may not be `path` or hold it); its nearest existing ancestor
    must be a writable folder (nothing can be created below a file)."""
    out = _real(path, option)
    for label, src in inputs:
        if src is None:
            continue
        p = _real(src, label)
        if out == p:
            raise OutputError(f"{option} {path} is {label} ({src}); choose a new path")
        if folder and out in p.parents and p.exists():
            raise OutputError(f"{option} {path} contains {label} ({src}); choose a folder of its own")
        if p in out.parents and not p.is_file():
            raise OutputError(f"{option} {path} is inside {label} ({src}); write it elsewhere")
    existing = next(p for p in _abs(path).parents if p.exists())
    if not existing.is_dir():
        raise OutputError(f"{option} {path}: {existing} is a file, not a directory; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: folder {existing} is not writable; choose another {option}")


def marker_files(folder: Path) -> set[str] | None:
    """The files our marker in `folder` lists, or None when there is no readable marker."""
    try:
        doc = json.loads((folder / MARKER).read_text())
        files = doc["files"] if doc.get("producer") == "kvcalib" else None
        return {str(f) for f in files} if isinstance(files, list) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def foreign_files(folder: Path) -> list[str]:
    """Entries of `folder` kvcalib did not write (relative paths): everything when it carries no marker.
    Symbolic links are never ours."""
    listed = marker_files(folder)
    found = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for name in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            r = (rel / name).as_posix()
            if r == MARKER and rel == Path("."):
                continue
            if listed is None or r not in listed or (Path(root) / name).is_symlink():
                found.append(r)
    return sorted(found)


def check_folder(out: Path, *, force: bool, inputs: Inputs = (), option: str = "--out") -> None:
    """May a folder output be written at `out`? Raises OutputError naming the reason and the fix."""
    out = Path(out)
    real, cwd = _real(out, option), Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        where = "is the current folder" if real == cwd else "holds the current folder"
        raise OutputError(f"{option} {out} {where}; choose a new folder for the output")
    _check_place(out, inputs, option, folder=True)
    if out.is_symlink():
        raise OutputError(f"{option} {out} is a symbolic link; give the folder itself or a new path")
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{option} {out} is a file, not a directory; choose another {option}")
    if not force:
        raise OutputError(f"output {out} already exists; pass --force to replace it or choose another {option}")
    if foreign := foreign_files(out):
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise OutputError(f"{option} {out} holds files kvcalib did not write ({foreign[0]}{more}); --force replaces "
                          "only a previous kvcalib output: remove them yourself or choose another folder")


def check_scratch(path: Path, *, inputs: Inputs = (), option: str) -> None:
    """A folder another library fills (accelerate's offload folder): never an input, inside one or holding one."""
    _check_place(Path(path), inputs, option, folder=True)


def is_statistics_file(path: Path) -> bool:
    """A kvcalib statistics (or resume) file: safetensors whose header metadata carries `kvcalib`."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")      # a short file reads a short header: not JSON below
            if not 2 <= n <= _MAX_HEADER:
                return False
            doc = json.loads(f.read(n))
        meta = doc.get("__metadata__") if isinstance(doc, dict) else None
        return isinstance(meta, dict) and "kvcalib" in meta
    except (OSError, ValueError):
        return False


def check_file(path: Path, *, inputs: Inputs = (), option: str, force: bool | None = False) -> None:
    """May a single-file output be written at `path`? `force=None`: one of ours is replaced without asking
    (the resume file); a file kvcalib did not write is never replaced."""
    path = Path(path)
    _check_place(path, inputs, option, folder=False)
    home = _abs(path).parent
    if (home / "config.json").is_file() and any(home.glob("*.safetensors")):
        # engines load every *.safetensors of a checkpoint without an index: a statistics file there breaks it
        raise OutputError(f"{option} {path} is inside a model checkpoint folder ({home}); write it elsewhere")
    if path.is_symlink():
        raise OutputError(f"{option} {path} is a symbolic link; give a new file path")
    if not path.exists():
        return
    if path.is_dir():
        raise OutputError(f"{option} {path} is a folder; give a file path")
    if not is_statistics_file(path):
        raise OutputError(f"{option} {path} is a file kvcalib did not write; kvcalib never replaces it: "
                          "choose another path")
    if force is False:
        raise OutputError(f"{option} {path} already exists; pass --force to replace it or choose another path")


def check_room(out: Path, files: Iterable[Path] = (), *, copies: int = 1, extra_bytes: int = 1 << 20,
               option: str = "--out") -> None:
    """Refuse before writing when the output filesystem cannot hold the output. `files` are linked when
    they live on the output's filesystem (no space) and copied `copies` times otherwise."""
    parent = next(p for p in _abs(out).parents if p.exists())
    dev = parent.stat().st_dev
    copied = sum(f.stat().st_size for f in files if f.stat().st_dev != dev)
    need = extra_bytes + copies * copied
    free = shutil.disk_usage(parent).free
    if free < need:
        raise OutputError(f"{option} {out}: folder {parent} has {free / 2**30:.2f} GiB free but the output needs "
                          f"{need / 2**30:.2f} GiB; free space or choose another {option}")


# ------------------------------------------------------------------------------------------- locks

_held: set[Path] = set()         # lock files this process holds


def _pid_in(lock: Path) -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        fd = os.open(lock, os.O_RDONLY | files.NOFOLLOW | files.CLOEXEC | os.O_NONBLOCK)
        try:
            return f" (pid {int(os.read(fd, 32).split()[0])})"
        finally:
            os.close(fd)
    return ""


def cleanup_stale(out: Path) -> None:
    """Remove what dead runs left beside `out` (call with `out`'s lock held): their temporary folders or files,
    after putting back a previous output one of them had moved aside."""
    out = _abs(out)
    name = "." + "".join(f"[{c}]" if c in "*?[]" else c for c in out.name)      # the name, glob-escaped
    for old in sorted(out.parent.glob(f"{name}{OLD_TAG}*")):
        if not out.exists() and not out.is_symlink() and old.is_dir() and not old.is_symlink():
            os.rename(old, out)       # a run died between moving the old output aside and renaming the new one
        else:
            _remove(old)
    for tmp in sorted(out.parent.glob(f"{name}{TMP_TAG}*")):
        _remove(tmp)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@contextlib.contextmanager
def lock(out: Path, option: str = "--out") -> Iterator[None]:
    """Hold the lock for output `out` (re-entrant within a process). A second process asking for it gets an
    OutputError at once. Parent folders created for it are removed again when they stay empty."""
    import fcntl

    out = _abs(out)
    path = lock_path(out)
    if path in _held:               # an inner `lock` of the same output: the outer one releases it
        yield
        return
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{option} {out}: cannot create folder {out.parent} ({e.strerror}); "
                          f"choose another {option}") from None
    fd = None
    try:
        while True:
            try:
                fd = files.open_existing(path, os.O_RDWR | os.O_CREAT)
            except files.LinkError as e:
                raise OutputError(f"{option} {out}: lock {e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                fd = None
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise OutputError(f"another kvcalib run{_pid_in(path)} is writing {out}; wait for it to finish "
                                      f"or choose another {option}") from None
                raise
            with contextlib.suppress(FileNotFoundError):   # the holder before us may have removed the file after
                if os.stat(path).st_ino == os.fstat(fd).st_ino:     # we opened it: lock the current one
                    break
            os.close(fd)
            fd = None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held.add(path)
        cleanup_stale(out)
        yield
    finally:
        _held.discard(path)
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            os.close(fd)
        for p in made:             # deepest first; only the ones this call created, and only while empty
            with contextlib.suppress(OSError):
                p.rmdir()


@contextlib.contextmanager
def locked(paths: Iterable[tuple[Path | None, str]]) -> Iterator[None]:
    """Hold the locks of several outputs (None entries are skipped), in a fixed order."""
    with contextlib.ExitStack() as stack:
        for p, option in sorted(((Path(p), o) for p, o in paths if p is not None), key=lambda x: str(_abs(x[0]))):
            stack.enter_context(lock(p, option))
        yield


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C while the block runs, so every `finally` on the way out runs:
    temporary outputs are removed and engine runners killed. Only the main thread can set handlers; elsewhere
    (embedded use) the caller's stay."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    previous = {s: signal.signal(s, unwind) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------- writing

def write_marker(folder: Path, kind: str) -> None:
    """List every file under `folder` in its marker (written last, into the temporary folder)."""
    from calib import __version__

    names = sorted((Path(root) / f).relative_to(folder).as_posix() for root, _, fs in os.walk(folder) for f in fs)
    doc = {"producer": "kvcalib", "version": __version__, "kind": kind, "files": [f for f in names if f != MARKER]}
    files.write_text(folder / MARKER, json.dumps(doc, indent=1) + "\n")


def add_file(out: Path, name: str, text: str, option: str = "--out") -> Path:
    """Write `name` into the finished kvcalib output folder `out` (atomically) and list it in the folder's marker,
    so a later --force still replaces the folder as ours: for what is known only once the output exists (a
    command's summary.json). OutputError where `out` carries no marker of ours."""
    out = Path(out)
    with lock(out, option):
        listed = marker_files(out)
        if listed is None:
            raise OutputError(f"{option} {out} is not a kvcalib output (no {MARKER}); {name} not written")
        doc = json.loads((out / MARKER).read_text())
        with atomic_file(out / name, option) as tmp:
            files.write_text(tmp, text)
        with atomic_file(out / MARKER, option) as tmp:
            files.write_text(tmp, json.dumps({**doc, "files": sorted({*listed, name})}, indent=1) + "\n")
    return out / name


@contextlib.contextmanager
def atomic_dir(out: Path, force: bool, *, inputs: Inputs = (), kind: str = "checkpoint",
               option: str = "--out") -> Iterator[Path]:
    """Yield a temporary sibling of `out` to fill; on success it carries our marker and replaces `out`
    (only where `check_folder` allows it, checked again at the end), on error it is removed."""
    out = Path(out)
    check_folder(out, force=force, inputs=inputs, option=option)
    with lock(out, option):
        tmp = tmp_path(_abs(out))
        _remove(tmp)
        try:
            files.make_dir(tmp)
        except files.LinkError as e:
            raise OutputError(f"{option} {out}: {e}") from None
        with _unwinding(tmp, out, option):
            yield tmp
            write_marker(tmp, kind)
            if out.exists() or out.is_symlink():
                check_folder(out, force=force, inputs=inputs, option=option)   # it may have changed meanwhile
                old = _abs(out).parent / f".{out.name}{OLD_TAG}{os.getpid()}"
                os.rename(out, old)
                os.rename(tmp, out)
                _remove(old)
            else:
                os.rename(tmp, out)


@contextlib.contextmanager
def _unwinding(tmp: Path, out: Path, option: str) -> Iterator[None]:
    """On any error `tmp` is removed: an OSError (disk full, permissions, a vanished folder) becomes one line, and
    every message names the user's `out`, never kvcalib's temporary sibling."""
    try:
        yield
    except OSError as e:
        _remove(tmp)
        why = e.strerror or str(e) or type(e).__name__
        why = f"{e.filename}: {why}" if e.filename else why
        raise OutputError(f"{option} {out}: writing failed ({why.replace(str(tmp), str(out))}); nothing was "
                          "written") from None
    except KvcalibError as e:
        # the temporary folder is gone when the user reads the message, and a command nested inside another (a
        # plan's route evaluation, a multi-target checkpoint's variants) would otherwise name
        # `.OUT.kvcalib-tmp-PID/...` as its --out
        _remove(tmp)
        e.args = tuple(a.replace(str(tmp), str(out)) if isinstance(a, str) else a for a in e.args)
        raise
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, option: str = "--out") -> Iterator[Path]:
    """Yield a temporary sibling file of `path`; renamed over `path` on success, removed on error. The
    caller has checked `path` with `check_file`."""
    path = Path(path)
    with lock(path, option):
        tmp = tmp_path(_abs(path))
        _remove(tmp)
        with _unwinding(tmp, path, option):
            yield tmp
            os.replace(tmp, path)
