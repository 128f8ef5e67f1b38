"""The README's examples run as written: every `kvcalib ...` line in a code block names a command and options that
command's `--help` lists, every `make ...` line a target and variables the Makefile has; the command map covers
every command; the "tested with" line is the one rendered from the pins; LICENSE is the license pyproject declares.

Why: the README is a new user's path, and an example that fails at its first option is where that user stops. The
options are read from each command's own `--help` (CliRunner on calib.cli), so a renamed or hidden option fails
here with the file and line of the example. docs/*.md examples are held to the same rule.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import tested_with
from calib.cli import main

ROOT = Path(__file__).resolve().parent.parent
MAP_START, MAP_END = "<!-- command-map:start -->", "<!-- command-map:end -->"
LICENSES = {"Apache-2.0": ("Apache License", "Version 2.0, January 2004"), "MIT": ("MIT License",)}


@dataclass(frozen=True)
class Example:
    where: str       # "README.md:42"
    line: str        # the command, continuation lines joined


def examples(text: str, name: str) -> list[Example]:
    """The `kvcalib ...` and `make ...` lines inside the code blocks of one markdown file."""
    out: list[Example] = []
    fenced, pending, start = False, "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        line = raw.strip()
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        line = re.sub(r"^\.venv/bin/", "", line)
        if line.startswith(("kvcalib ", "make ")) or line == "make":
            out.append(Example(f"{name}:{start}", line))
    return out


def _words(line: str) -> list[str]:
    """Shell words, comments dropped; `[OPT]` placeholders are checked as OPT."""
    return [w.strip("[]") for w in shlex.split(line, comments=True) if w.strip("[]")]


def help_options(path: tuple[str, ...]) -> set[str]:
    """Every option name a command's `--help` lists (both names of `--a, --b` and of `--x / --no-x`)."""
    r = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    names: set[str] = set()
    body = r.output.split("Options:", 1)[1].split("Commands:", 1)[0]
    for line in body.splitlines():
        if re.match(r"^ {2}-", line):
            column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            names.update(w.rstrip(",") for w in column.split() if w.startswith("-"))
    return names


def check_kvcalib(ex: Example) -> list[str]:
    words = _words(ex.line)[1:]
    group: click.Command = main
    path: list[str] = []
    while isinstance(group, click.Group) and words and words[0] in group.commands:
        path.append(words[0])
        group = group.commands[words.pop(0)]
    if not path:
        got = words[0] if words else "nothing"
        return [f"{ex.where}: `kvcalib {got}` is not a command ({', '.join(sorted(main.commands))}): {ex.line}"]
    known = help_options(tuple(path))
    bad = [w.split("=", 1)[0] for w in words if re.match(r"^--?[A-Za-z]", w)]
    return [f"{ex.where}: `kvcalib {' '.join(path)}` has no option {b} in its --help: {ex.line}"
            for b in bad if b not in known]


def makefile() -> tuple[set[str], set[str]]:
    """The Makefile's targets and the variables it reads."""
    text = (ROOT / "Makefile").read_text()
    targets = {t for m in re.finditer(r"^([A-Za-z0-9_. -]+?)\s*:(?!=)", text, flags=re.M) for t in m.group(1).split()}
    variables = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text)) | set(re.findall(r"^([A-Z_][A-Z0-9_]*) *\?=", text,
                                                                                      flags=re.M))
    return targets, variables


def check_make(ex: Example, targets: set[str], variables: set[str]) -> list[str]:
    out = []
    for w in _words(ex.line)[1:]:
        if w.startswith("-"):
            continue
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w):
            var = w.split("=", 1)[0]
            if var not in variables:
                out.append(f"{ex.where}: the Makefile reads no variable {var}: {ex.line}")
        elif w not in targets:
            out.append(f"{ex.where}: the Makefile has no target {w!r}: {ex.line}")
    return out


def problems(text: str, name: str) -> list[str]:
    targets, variables = makefile()
    out: list[str] = []
    for ex in examples(text, name):
        out += check_kvcalib(ex) if ex.line.startswith("kvcalib") else check_make(ex, targets, variables)
    return out


def command_map(readme: str) -> list[list[str]]:
    """The map's rows (question, command, output), header and separator left out."""
    assert readme.count(MAP_START) == readme.count(MAP_END) == 1, f"README.md needs one {MAP_START} and one {MAP_END}"
    block = readme.split(MAP_START, 1)[1].split(MAP_END, 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in block.splitlines() if ln.startswith("|")]
    return rows[2:]


# ------------------------------------------------------------------------------ the README and docs

def test_the_readme_examples_name_real_commands_options_and_targets():
    readme = (ROOT / "README.md").read_text()
    found = examples(readme, "README.md")
    assert len(found) >= 15, found                 # the walk sees the examples (it had 22)
    assert not problems(readme, "README.md"), "\n".join(problems(readme, "README.md"))


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_the_docs_examples_name_real_commands_options_and_targets(doc):
    assert not problems((ROOT / "docs" / doc).read_text(), f"docs/{doc}"), \
        "\n".join(problems((ROOT / "docs" / doc).read_text(), f"docs/{doc}"))


def test_the_command_map_covers_every_command_and_names_only_real_ones():
    rows = command_map((ROOT / "README.md").read_text())
    assert rows and all(len(r) == 3 and all(r) for r in rows), rows
    named = [c for r in rows for c in re.findall(r"`kvcalib ([a-z-]+)", r[1])]
    unknown = sorted(set(named) - set(main.commands))
    missing = sorted(set(main.commands) - set(named))
    assert unknown == [] and missing == [], f"not commands: {unknown}; commands the map leaves out: {missing}"
    targets, _ = makefile()
    assert {t for r in rows for t in re.findall(r"`make ([a-z-]+)", r[1])} <= targets


def test_every_command_in_the_map_has_a_section_with_an_example():
    readme = (ROOT / "README.md").read_text()
    shown = {_words(ex.line)[1] for ex in examples(readme, "README.md") if ex.line.startswith("kvcalib")}
    main_ones = {c for r in command_map(readme) for c in re.findall(r"`kvcalib ([a-z-]+)`", r[1])[:1]}
    assert main_ones - {"recipes", "default-model"} <= shown, sorted(main_ones - shown)


def test_the_tested_with_line_is_rendered_from_the_pins_and_the_support_matrix():
    assert tested_with.block((ROOT / "README.md").read_text()) == tested_with.line(), \
        "the README's tested-with line is stale: run `python tests/tested_with.py README.md`"


def test_the_license_file_is_the_license_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    text = (ROOT / "LICENSE").read_text()
    assert declared in LICENSES, f"pyproject.toml declares {declared!r}: add its LICENSE header to this test"
    assert all(h in text[:400] for h in LICENSES[declared]), f"LICENSE is not the {declared} text"


# ------------------------------------------------------------------------------ the checker itself

def test_examples_are_read_from_code_blocks_only_with_continuations_joined():
    text = ("kvcalib eval --nope outside a block\n```bash\n.venv/bin/kvcalib eval --samples 4 \\\n"
            "    --buckets 128   # a comment --nope\nmake test\npip install x\n```\n")
    assert examples(text, "X.md") == [Example("X.md:3", "kvcalib eval --samples 4  --buckets 128   # a comment --nope"),
                                      Example("X.md:5", "make test")]
    assert problems(text, "X.md") == []


def test_an_unknown_command_option_target_or_variable_is_named_with_its_line():
    text = "```\nkvcalib evaluate --out x\nkvcalib eval --sample 4 [--no-such]\nmake tset\nmake eval MODLE=m\n```\n"
    assert problems(text, "X.md") == [
        f"X.md:2: `kvcalib evaluate` is not a command ({', '.join(sorted(main.commands))}): kvcalib evaluate --out x",
        "X.md:3: `kvcalib eval` has no option --sample in its --help: kvcalib eval --sample 4 [--no-such]",
        "X.md:3: `kvcalib eval` has no option --no-such in its --help: kvcalib eval --sample 4 [--no-such]",
        "X.md:4: the Makefile has no target 'tset': make tset",
        "X.md:5: the Makefile reads no variable MODLE: make eval MODLE=m"]


def test_help_options_reads_both_names_of_an_option_and_of_a_flag_pair():
    assert {"--pack", "--no-pack", "--emulate", "--out", "-h", "--help"} <= help_options(("eval",))
    assert {"--engine", "--target"} <= help_options(("verify",))
    assert "--no-such" not in help_options(("eval",))
    assert help_options(("recipes", "show")) >= {"--help"}
