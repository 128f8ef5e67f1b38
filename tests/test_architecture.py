"""The package's seams, read from the source with `ast`: no module reaches into another module's private
names, and the checkpoint layout (calib.ckpt) and the checkers built on it import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import calib

ROOT = Path(calib.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from."""
    if not node.level:
        return node.module or ""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(mod: str, path: Path) -> list[str]:
    """`from calib.x import _name` and `x._name` (x a calib module imported here), x not this module."""
    tree = ast.parse(path.read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(mod, path, node)
            if not source.startswith("calib"):
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in MODULES:
                    aliases[a.asname or a.name] = sub
                elif _private(a.name) and source != mod:
                    found.append(f"{mod} imports {source}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("calib") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and _private(node.attr) and aliases[node.value.id] != mod:
            found.append(f"{mod} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_the_checker_sees_a_private_import(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("from .model import _hidden\nfrom . import model as mm\nmm._other()\nfrom .ckpt import names\n")
    assert private_uses("calib.m", fake) == ["calib.m imports calib.model._hidden", "calib.m uses calib.model._other"]


def test_no_module_imports_another_modules_private_names():
    found = [f for mod, path in MODULES.items() for f in private_uses(mod, path)]
    assert found == []


def test_checkpoint_layout_readers_import_no_torch():
    code = ("import sys; import calib.ckpt.names, calib.ckpt.formats, calib.ckpt.reader, calib.ckpt.kvinfo, "
            "calib.ckpt.source, calib.verify; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
