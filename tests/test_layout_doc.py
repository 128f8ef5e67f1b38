"""docs/layout.md's tree is the package: one line per file under calib/, each saying what the file is for.

The tree (between `<!-- layout:start -->` and `<!-- layout:end -->`) is read as indentation, two spaces a level,
a name (a folder ends in `/`) and its description; the files are read from the checkout beside this test, not
from the installed package. A file added or removed without its line fails with the exact lines to add or remove.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = "docs/layout.md"
START, END = "<!-- layout:start -->", "<!-- layout:end -->"
INDENT = 2          # spaces per level
NAME_WIDTH = 26     # the column the descriptions start at
WIDTH = 116         # the widest line the tree keeps (markdown code blocks do not scroll)
LINE = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z0-9_.-]+/?)(?: {2,}(?P<what>\S.*))?$")


@dataclass(frozen=True)
class Entry:
    path: str        # "calib/ckpt/names.py", "calib/ckpt/"
    what: str
    lineno: int      # the document's line
    line: str


def block(readme: str) -> tuple[str, int]:
    """The text between the markers and the document line number of its first line."""
    assert readme.count(START) == readme.count(END) == 1, f"{DOC} needs one {START} and one {END}"
    head, rest = readme.split(START, 1)
    return rest.split(END, 1)[0], head.count("\n") + 1


def parse_tree(text: str, first_lineno: int = 1) -> list[Entry]:
    """Every entry of a layout block, its path built from the folders above it."""
    entries: list[Entry] = []
    folders: list[str] = []
    for n, line in enumerate(text.splitlines(), first_lineno):
        if not line.strip() or line.startswith("```"):
            continue
        m = LINE.match(line)
        depth = len(m["indent"]) // INDENT if m else 0
        if not m or len(m["indent"]) % INDENT or depth > len(folders):
            raise ValueError(f"{DOC}:{n}: not a tree line (indent {INDENT} spaces a level under a folder, "
                             f"name, two spaces, description): {line!r}")
        if not m["what"]:
            raise ValueError(f"{DOC}:{n}: {m['name']} has no description: {line!r}")
        del folders[depth:]
        path = "".join(folders) + m["name"]
        if m["name"].endswith("/"):
            folders.append(m["name"])
        entries.append(Entry(path, m["what"], n, line))
    return entries


def on_disk(root: Path) -> dict[str, Path]:
    """Every .py file under root/calib and every folder holding one, as the tree spells them."""
    found: dict[str, Path] = {}
    for p in sorted((root / "calib").rglob("*.py")):
        rel = p.relative_to(root)
        found[rel.as_posix()] = p
        for parent in rel.parents[:-1]:
            found.setdefault(parent.as_posix() + "/", root / parent)
    return found


def summary(path: Path) -> str:
    """What a file is for, as it says itself: its docstring's first line (a folder: its __init__'s)."""
    source = path / "__init__.py" if path.is_dir() else path
    doc = ast.get_docstring(ast.parse(source.read_text())) if source.exists() else None
    return (doc or "WHAT IT IS FOR").splitlines()[0].strip()


def tree_line(path: str, what: str) -> str:
    parts = path.rstrip("/").split("/")
    name = parts[-1] + ("/" if path.endswith("/") else "")
    return f"{' ' * INDENT * (len(parts) - 1)}{name}".ljust(NAME_WIDTH) + what


def differences(entries: list[Entry], disk: dict[str, Path]) -> list[str]:
    """What to change in the tree so that it lists exactly the files on disk, one instruction a line."""
    out: list[str] = []
    listed: dict[str, Entry] = {}
    for e in entries:
        if e.path in listed:
            out.append(f"remove {DOC} line {e.lineno} (it repeats line {listed[e.path].lineno}): {e.line!r}")
        else:
            listed[e.path] = e
    for path in sorted(set(listed) - set(disk)):
        out.append(f"remove {DOC} line {listed[path].lineno} (no such file): {listed[path].line!r}")
    for path in sorted(set(disk) - set(listed), key=lambda p: (p.rstrip("/").count("/"), p)):
        parent = path.rstrip("/").rpartition("/")[0] + "/"
        inside = [e.lineno for e in listed.values() if e.path.startswith(parent) and e.path in disk]
        where = f"after {DOC} line {max(inside)}, in {parent}" if inside else f"under the new folder {parent}"
        line = tree_line(path, summary(disk[path]))
        width = f" (then shorten its description to {WIDTH} columns)" if len(line) > WIDTH else ""
        out.append(f"add {where}: {line!r}{width}")
    return out


def test_the_tree_lists_every_file_of_the_package_and_nothing_else():
    text, first = block((ROOT / DOC).read_text())
    entries = parse_tree(text, first)
    disk = on_disk(ROOT)
    assert {"calib/", "calib/cli.py", "calib/recipe/", "calib/recipe/recipe.py", "calib/ckpt/names.py"} <= set(disk)
    assert len(disk) > 60                       # the walk sees the package (it had 100 files and folders)
    todo = differences(entries, disk)
    assert not todo, f"the {DOC} tree differs from calib/:\n" + "\n".join(todo)


def test_every_tree_line_fits_and_says_something():
    text, first = block((ROOT / DOC).read_text())
    entries = parse_tree(text, first)
    wide = [f"{DOC}:{e.lineno} is {len(e.line)} columns" for e in entries if len(e.line) > WIDTH]
    bare = [f"{DOC}:{e.lineno}" for e in entries if len(e.what.split()) < 2]
    assert wide == [] and bare == []


# ------------------------------------------------------------------------------ the checker itself

def test_the_tree_is_read_as_paths():
    text = "```\ncalib/    the package\n  a.py    first\n  sub/    a folder\n    b.py  second\n  c.py    third\n```\n"
    assert [(e.path, e.what, e.lineno) for e in parse_tree(text, 10)] == [
        ("calib/", "the package", 11), ("calib/a.py", "first", 12), ("calib/sub/", "a folder", 13),
        ("calib/sub/b.py", "second", 14), ("calib/c.py", "third", 15)]
    with pytest.raises(ValueError, match="docs/layout.md:2: b.py has no description"):
        parse_tree("calib/  the package\n  b.py\n")
    with pytest.raises(ValueError, match="docs/layout.md:2: not a tree line"):
        parse_tree("calib/  the package\n     b.py  odd indent\n")


def test_the_differences_name_the_lines_to_add_and_remove(tmp_path):
    (tmp_path / "calib" / "sub").mkdir(parents=True)
    (tmp_path / "calib" / "new").mkdir()
    (tmp_path / "calib" / "a.py").write_text('"""First."""\n')
    (tmp_path / "calib" / "sub" / "b.py").write_text('"""Second thing.\n\nMore."""\n')
    (tmp_path / "calib" / "new" / "__init__.py").write_text('"""A new stage."""\n')
    entries = parse_tree("calib/  the package\n  a.py  first\n  gone.py  was here\n  sub/  a folder\n  a.py  again\n")
    assert differences(entries, on_disk(tmp_path)) == [
        "remove docs/layout.md line 5 (it repeats line 2): '  a.py  again'",
        "remove docs/layout.md line 3 (no such file): '  gone.py  was here'",
        "add after docs/layout.md line 4, in calib/: '  new/                    A new stage.'",
        "add under the new folder calib/new/: '    __init__.py           A new stage.'",
        "add after docs/layout.md line 4, in calib/sub/: '    b.py                  Second thing.'"]
