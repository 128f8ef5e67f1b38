"""Creating files and folders without following links: every entry kvcalib creates goes through here.

Why: kvcalib writes beside and into paths the user names (locks, temporary siblings, markers, statistics,
checkpoints, reports). A symbolic link planted where one of those entries will appear would make an
ordinary `open(path, "w")` write through it, into a file the user never meant to give (the lock file
once wrote its pid into whatever file a link at `.OUT.kvcalib-lock` pointed to). Here every new file is
created with O_CREAT | O_EXCL | O_NOFOLLOW (a link, or anything already there, is refused by the kernel,
not by a check that could race), and a file that must be reopened (the lock) is checked on its open
descriptor: a regular file with one link. Links *above* the entry (a folder the user linked) are followed:
the user chose them; the entry kvcalib creates never is a link.

A write that fails (disk full, a file-size limit, a vanished folder) raises OSError, which the atomic
writers of `outputs` turn into one line with nothing left behind; safetensors' own error for the same
failures is turned into that OSError here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from calib.errors import KvcalibError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 20


class LinkError(KvcalibError, ValueError):
    """Something other than a plain new file sits where kvcalib creates one; nothing was written."""


class PathError(KvcalibError, ValueError):
    """A path the user gave cannot be turned into a place on this machine (`~user` of an unknown user)."""


def expand_user(path: str | Path, what: str = "") -> Path:
    """`path` with a leading `~` / `~user` expanded. pathlib raises a bare RuntimeError (a traceback) for a user
    this machine does not know or a home it cannot find: here it is one line naming `what` and the path."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        head = str(path).split("/", 1)[0]
        who = f"no user {head[1:]!r} on this machine" if len(head) > 1 else "no home folder is known here"
        raise PathError(f"{what + ' ' if what else ''}{path}: {who} ({head}); give the full path") from None


def refuse_link(path: Path) -> None:
    """A one-line error when `path` itself is a symbolic link."""
    if os.path.islink(path):
        raise LinkError(f"{path} is a symbolic link where kvcalib writes; kvcalib never writes through a link: "
                        "remove the link or choose another path")


def create(path: Path, mode: int = 0o644) -> int:
    """A descriptor of a new regular file at `path`, opened for writing; refuses a link or anything there."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)
    except FileExistsError:
        refuse_link(path)
        raise LinkError(f"{path} already exists where kvcalib creates a new file; remove it or choose another "
                        "path") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise


def open_existing(path: Path, flags: int, mode: int = 0o644) -> int:
    """Open (creating if missing) a file kvcalib shares with other runs (the lock): never through a link, and
    only a regular file with a single name (a hard link to someone's file would be written through)."""
    try:
        fd = os.open(path, flags | NOFOLLOW | CLOEXEC | getattr(os, "O_NONBLOCK", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} hard links"
        raise LinkError(f"{path} is {what}; kvcalib writes only files it created there: remove it")
    return fd


@contextlib.contextmanager
def open_new(path: Path, mode: str = "w", **kw: Any) -> Iterator[IO]:
    """`open(path, mode)` for a new file (text "w" or binary "wb"), created as `create` does."""
    fd = create(Path(path))
    with os.fdopen(fd, mode, **({"encoding": "utf-8"} if "b" not in mode else {}), **kw) as f:
        yield f


def write_text(path: Path, text: str) -> None:
    with open_new(path, "w") as f:
        f.write(text)


def write_bytes(path: Path, data: bytes) -> None:
    with open_new(path, "wb") as f:
        f.write(data)


def copy(src: Path, dst: Path) -> None:
    """Copy `src`'s bytes (and times) into a new file `dst`."""
    with open(src, "rb") as fin, open_new(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, _CHUNK)
    shutil.copystat(src, dst, follow_symlinks=False)


def make_dir(path: Path) -> None:
    """A new folder at `path` (its parents must exist); a link or anything else there is refused."""
    try:
        os.mkdir(path)
    except FileExistsError:
        refuse_link(path)
        raise LinkError(f"{path} already exists where kvcalib creates a new folder; remove it or choose another "
                        "path") from None


def place(src: Path, dst: Path) -> None:
    """Move the finished file `src` (in a folder only this process writes) to the new name `dst`: a hard link
    (refused by the kernel when anything, a link included, is at `dst`), or a rename where links are impossible."""
    try:
        os.link(src, dst)
    except FileExistsError:
        refuse_link(dst)
        raise LinkError(f"{dst} already exists where kvcalib creates a new file; remove it or choose another "
                        "path") from None
    except OSError:
        refuse_link(dst)
        if os.path.lexists(dst):
            raise LinkError(f"{dst} already exists where kvcalib creates a new file; remove it") from None
        os.rename(src, dst)
    else:
        os.unlink(src)


IN_MEMORY = 256 << 20       # tensors up to this size are serialized in memory and written through our descriptor
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def save_tensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """A new safetensors file at `path`. Small ones (statistics, scale shards) are serialized in memory and
    written through `create`'s descriptor; a large one (a weight shard re-saved without its old KV scales) is
    written by safetensors into a private folder beside `path` (mkdtemp: mode 0700, a fresh name) and then
    `place`d. safetensors' own write errors come back as OSError."""
    from safetensors.torch import save, save_file

    path = Path(path)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        if size <= IN_MEMORY:
            write_bytes(path, save(tensors, metadata=metadata))
            return
        refuse_link(path)
        private = Path(tempfile.mkdtemp(prefix=".kvcalib-save-", dir=path.parent))
        try:
            save_file(tensors, str(private / path.name), metadata=metadata)
            place(private / path.name, path)
        finally:
            shutil.rmtree(private, ignore_errors=True)
    except (OSError, KvcalibError):
        raise
    except Exception as e:     # safetensors' SafetensorError: "I/O error: File too large (os error 27)"
        m = _OS_ERROR.search(str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None
