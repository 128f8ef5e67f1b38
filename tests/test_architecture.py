"""The package's seams, read from the source with `ast`: no module reaches into another module's private
names, no two modules import each other (directly or round a loop), the stages are layered (the recipe and
the checkpoint layout load nothing heavy; data, model, capture and scales import no later stage), and the
checkers built on the checkpoint layout import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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
    fake.write_text("from .model.load import _hidden\nfrom .model import load as mm\nmm._other()\nfrom .ckpt import names\n")
    assert private_uses("calib.m", fake) == ["calib.m imports calib.model.load._hidden", "calib.m uses calib.model.load._other"]


def test_no_module_imports_another_modules_private_names():
    found = [f for mod, path in MODULES.items() for f in private_uses(mod, path)]
    assert found == []


# What the recipe and the checkpoint layout never load: they run at the command line's start, in `verify` and
# `inspect` on a machine without a GPU stack. numpy (the checkpoint reader decodes scale values with it),
# safetensors' numpy reader and yaml (recipes) are light and allowed.
HEAVY = ("torch", "transformers", "accelerate", "datasets", "pyarrow", "triton", "huggingface_hub", "safetensors.torch")
LIGHT_PACKAGES = ("calib.recipe", "calib.ckpt")


def _in(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def test_checkpoint_layout_readers_and_the_vocabulary_import_no_torch():
    """Every module of recipe/ and ckpt/ (read from disk), the checkers and the targets, imported together in a
    fresh interpreter, load none of HEAVY."""
    light = sorted(m for m in MODULES if _in(m, LIGHT_PACKAGES))
    assert {"calib.ckpt.reader", "calib.recipe.recipe"} <= set(light)
    code = (f"import sys; import {', '.join(light)}, calib.verify, calib.export; "
            f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def heavy_imports(mod: str, source: str) -> list[str]:
    """Imports of HEAVY packages anywhere in a module, inside functions too (a lazy import still runs when the
    function does), but not under `if TYPE_CHECKING:` (annotations only)."""
    found = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = []
        found.extend(f"{mod}:{node.lineno} imports {n}" for n in [n for n in names if _in(n, HEAVY)][:1])
        for child in ast.iter_child_nodes(node):
            if not _type_checking(child):
                walk(child)

    walk(ast.parse(source))
    return found


def test_the_heavy_import_finder_finds_one():
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nimport numpy\n"
           "def f():\n    from safetensors.torch import save_file\n    from safetensors import safe_open\n")
    assert heavy_imports("m", src) == ["m:6 imports safetensors.torch"]
    assert heavy_imports("m", "import os, torch.nn\nfrom safetensors import torch\n") == \
        ["m:1 imports torch.nn", "m:2 imports safetensors.torch"]


def test_the_recipe_and_the_checkpoint_layout_import_nothing_heavy_even_lazily():
    found = [f for mod, path in MODULES.items() if _in(mod, LIGHT_PACKAGES)
             for f in heavy_imports(mod, path.read_text())]
    assert found == []


def import_graph() -> dict[str, set[str]]:
    """Module -> the calib modules it imports, at module level or inside a function (a lazy import hides a
    cycle from the interpreter's start-up, not from the design)."""
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(mod, path, node)
                if source.startswith("calib"):
                    deps |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("calib")}
        graph[mod] = {d for d in deps if d in MODULES and d != mod and not mod.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "calib.capture.spec" in graph["calib.capture.statsfile"]          # the graph sees imports (lazy ones too)
    assert cycles(graph) == []


# The packages' order, lowest first: a first-level package (or module) of calib imports, at module level or
# lazily, only from the packages before it. Facts sit at the bottom (the recipe vocabulary and the support matrix,
# the checkpoint layout: nothing heavy), then the stages that produce values (data, model, scales, capture), the
# engine that measures, the export that writes, the decisions (the evaluation's verdict, tune, validate, routes),
# and the command line on top (its shared options and its summary.json under the commands).
ORDER = ("calib", "calib.errors", "calib.progress", "calib.resources", "calib.discovery", "calib.safety",
         "calib.provenance", "calib.recipe", "calib.ckpt", "calib.data", "calib.model", "calib.scales",
         "calib.capture", "calib.engine", "calib.load", "calib.export", "calib.verify", "calib.evaluation",
         "calib.pipeline", "calib.tune", "calib.validate", "calib.routes", "calib.cli_options", "calib.summary",
         "calib.cli")


def package_of(mod: str) -> str:
    """calib's first-level package (or module) that holds `mod`: calib.engine.run -> calib.engine. A stage's
    `cli.py` is its command's front end and counts as the command line (calib.cli), above every stage."""
    return "calib.cli" if mod.endswith(".cli") else ".".join(mod.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """First-level package -> the other first-level packages its modules import."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(package_of(mod), set()).update(package_of(d) for d in deps)
    return {p: deps - {p} for p, deps in out.items()}


def upward(packages: dict[str, set[str]], order: tuple[str, ...]) -> set[str]:
    """`package imports later-package` for every package import that goes up the order (a package the order does
    not name is neither: `test_every_package_has_its_place_in_the_order` names it)."""
    rank = {p: i for i, p in enumerate(order)}
    return {f"{p} imports {d}" for p, deps in packages.items() for d in deps
            if rank.get(d, -1) > rank.get(p, len(order))}


def test_the_package_checkers_find_a_loop_and_an_upward_import():
    graph = {"calib.scales.fold": {"calib.capture.stats"}, "calib.capture.hook": {"calib.scales.quant"},
             "calib.tune.cli": {"calib.capture.hook"}}
    packages = package_graph(graph)
    assert packages == {"calib.scales": {"calib.capture"}, "calib.capture": {"calib.scales"},
                        "calib.cli": {"calib.capture"}}
    assert cycles(packages) == [["calib.capture", "calib.scales"]]
    assert upward(packages, ORDER) == {"calib.scales imports calib.capture"}


def test_every_package_has_its_place_in_the_order():
    on_disk = set(package_graph(import_graph()))
    assert (on_disk - set(ORDER), set(ORDER) - on_disk) == (set(), set())


def test_no_package_imports_another_round_a_loop():
    """Acyclic between packages, not only between modules: a loop through packages makes every package on it
    a dependency of every other (the engine would need the evaluation to load, the scales the capture)."""
    packages = package_graph(import_graph())
    assert "calib.scales" in packages["calib.capture"]          # the graph sees package imports
    assert cycles(packages) == []


def test_the_packages_import_only_down_the_order():
    assert upward(package_graph(import_graph()), ORDER) == set()


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported as the first calib module of a fresh interpreter (a cycle or a missing name
    shows up as ImportError whichever module a caller happens to load first). Slow: one interpreter each."""
    mods = sorted(MODULES)
    code = ("import importlib, subprocess, sys\n"
            "bad = []\n"
            "for m in sys.argv[1:]:\n"
            "    r = subprocess.run([sys.executable, '-c', f'import {m}'], capture_output=True, text=True)\n"
            "    if r.returncode: bad.append(f'{m}: {r.stderr.strip().splitlines()[-1]}')\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_test_module_imports_another():
    """Shared test code lives in helpers.py (and tiny.py, conftest.py), never in a test module."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(tests)} imports {n}" for n in names
                      if any(part.startswith("test_") for part in n.split("."))]
    assert found == []


def test_the_provenance_is_built_complete_not_patched():
    """Stages hand values on: the run's record is built once by `pipeline.provenance` with everything it
    names; no stage that builds one assigns into it afterwards (`prov[...] = ...`), so no call order matters."""
    patched = []
    for mod, path in MODULES.items():
        if not (mod == "calib.pipeline" or mod.startswith("calib.tune")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            patched += [f"{mod}:{node.lineno}" for t in targets
                        if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "prov"]
    assert patched == []


def test_the_fake_quant_hooks_switches_change_only_through_applying():
    """Callers set the hook's arm, meter and range recorder (and, in the evaluation, its padding mask) for one
    batch with `FakeQuantKV.applying`, and the capture's padding mask with `KVCapture.masking`, which switch
    them all off after; never by assignment, where a switch left on leaks into the next pass (an object's own
    attributes, `self.meter`, are its own business)."""
    bench = {f"bench.{p.stem}": p for p in sorted((ROOT.parent / "bench").glob("*.py"))}
    switched = []
    for mod, path in {**MODULES, **bench}.items():
        if mod == "calib.evaluation.fakequant":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                own = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                if isinstance(t, ast.Attribute) and not own and (t.attr in ("arm", "meter", "ranges") or
                                                                 t.attr == "token_mask"):
                    switched.append(f"{mod}:{node.lineno} sets .{t.attr}")
    assert switched == []


# Modules that run outside the calib package (the engine runner imports them by file path, standard library
# only), so their errors cannot derive from calib.errors; the caller converts them (engine.driver: not_run).
STANDALONE = {"calib.engine.protocol", "calib.engine.vllm_runner"}


def test_every_error_class_derives_from_the_one_base():
    """The command line catches `KvcalibError` once: an error class that does not derive from it would reach
    the user as a traceback. Every exception class defined under calib/ is imported and checked."""
    import importlib

    from calib.errors import KvcalibError

    loose, seen = [], 0
    for mod in sorted(set(MODULES) - STANDALONE):
        module = importlib.import_module(mod)
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == mod:
                seen += 1
                if not issubclass(value, KvcalibError):
                    loose.append(f"{mod}.{name}")
    assert seen >= 21                                   # the walk sees the classes (there were 21 when it was written)
    assert loose == []

