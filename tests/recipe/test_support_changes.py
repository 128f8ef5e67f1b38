"""How many files a change touches, as worked examples: a made-up static KV format and a made-up export target are
added to a copy of the package, each by editing the files the change needs and nothing else, and a fresh
interpreter checks that the matrix, the recipe, the targets, the serve commands, tune's space, the bytes model and
the emulation all pick the addition up (issue 40: a static format in at most 3 files, an export target in 3).

The copies are the package's own source; the edits are plain text appended or substituted, so a test fails the
day a registry stops being derived (the addition would then be missing somewhere, or need a fourth file).
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import calib

ROOT = Path(calib.__file__).resolve().parent


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "calib"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _edit(path: Path, old: str | None, new: str) -> None:
    text = path.read_text()
    if old is None:
        path.write_text(text + new)
        return
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


def _changed(tmp_path: Path) -> list[str]:
    """The files of the copy that differ from the package, or are new there."""
    out = []
    for p in sorted((tmp_path / "calib").rglob("*.py")):
        rel = p.relative_to(tmp_path)
        orig = ROOT.parent / rel
        if not orig.is_file() or not filecmp.cmp(p, orig, shallow=False):
            out.append(str(rel))
    return out


def _check(tmp_path: Path, code: str) -> None:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok", r.stdout


def test_a_static_kv_format_is_two_files(tmp_path):
    """A made-up static format, `fp8_e3m4`, that only vLLM has: its registry entry (calib/recipe/dtypes.py) and what
    vLLM does with its scales (calib/recipe/support/engines/vllm.py). The other engines refuse it without an edit;
    the recipe, vLLM's target, its serve command, tune's space, the bytes model and the emulation's rounding take
    it."""
    pkg = _copy(tmp_path)
    _edit(pkg / "recipe/dtypes.py", "# Every KV format kvcalib knows", 'FP8_E3M4 = KVDtype("fp8_e3m4", 31.0, '
          'short="e3m4", engines={"vllm": Served(("fp8_e3m4",))})\n# Every KV format kvcalib knows')
    _edit(pkg / "recipe/dtypes.py", "INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD)}",
          "INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD, FP8_E3M4)}")
    _edit(pkg / "recipe/support/engines/vllm.py", None, textwrap.dedent('''
        CELLS += (c("*", "fp8_e3m4", ("tensor", "head", "q_scale", "q_absent"), E.APPLIED, "made up", V2),
                  c("*", "fp8_e3m4", "skip_layers", E.REFUSED, _SKIP_OLD, V8, until="0.19"),
                  c("*", "fp8_e3m4", "skip_layers", E.APPLIED, _SKIP, V4, V8, since="0.19"))
    '''))
    assert _changed(tmp_path) == ["calib/recipe/dtypes.py", "calib/recipe/support/engines/vllm.py"]
    _check(tmp_path, '''
        import itertools
        from calib.engine import command
        from calib.export import TARGETS
        from calib.model import layer_kinds
        from calib.recipe import recipe, support
        from calib.tune import space

        assert "fp8_e3m4" in support.STATIC_FORMATS and "fp8_e3m4" in recipe.DTYPES
        for name, e in support.ENGINES.items():          # exactly one cell everywhere, the lacking engines refuse
            for b, a in itertools.product(e.backends, support.ASPECTS):
                c = support.cell(name, None, b, "fp8_e3m4", a)
                assert (c.effect is support.Effect.REFUSED) == (name != "vllm"), c
        assert recipe.Recipe(dtype="fp8_e3m4", targets=("vllm",), skip_layers=(1,)).kv_dtype.qmax == 31.0
        try:
            recipe.Recipe(dtype="fp8_e3m4", targets=("sglang",))
            raise SystemExit("sglang took it")
        except recipe.RecipeError as err:
            assert "SGLang has no static E3M4 KV cache" in str(err), err
        assert [d.name for d in TARGETS["vllm"].dtypes] == ["fp8_e4m3", "fp8_e3m4"]
        assert "fp8_e3m4" not in [d.name for d in TARGETS["trtllm"].dtypes]
        assert command.line("vllm", "m", "fp8_e3m4") == "vllm serve m --kv-cache-dtype fp8_e3m4"
        assert "e3m4/head/absmax/h1+q" in [c.name for c in space.generate("vllm", ("absmax",), (1.0,))]
        assert layer_kinds.DTYPE_BYTES["fp8_e3m4"] == 1
        assert "| fp8_e3m4 |" in support.markdown()
        import torch                                  # the emulation rounds it as its entry says (no cast: integers)
        from calib.recipe import dtypes
        from calib.scales import quant
        q = quant.quantize(torch.tensor([40.0, 2.4, -2.6, 2.5]), 1.0, dtypes.KV_FORMATS["fp8_e3m4"])
        assert q.tolist() == [31.0, 2.0, -3.0, 2.0], q
        print("ok")
    ''')


def test_an_export_target_is_three_files(tmp_path):
    """A made-up engine, `toyserve`, that serves vLLM's layout with FP8 per tensor: its writer
    (calib/export/toyserve.py), its support-matrix module (calib/recipe/support/engines/toyserve.py: how it is
    served, what it does with the scales) and its name for FP8 (calib/recipe/dtypes.py). The recipe, `targets()`
    (what `inspect` lists), the serve command, verify's engine order and the matrix take it."""
    pkg = _copy(tmp_path)
    (pkg / "export/toyserve.py").write_text(textwrap.dedent('''
        """A made-up engine that loads vLLM's compressed-tensors layout."""
        from calib.export.target import Target
        from calib.export.vllm import export_vllm


        class ToyTarget(Target):
            name = "toyserve"
            order = 4

            def write(self, source, out, scales, provenance, options):
                return export_vllm(source, out, scales, provenance, force=options.force)


        TARGET = ToyTarget()
    '''))
    (pkg / "recipe/support/engines/toyserve.py").write_text(textwrap.dedent('''
        """A made-up engine: FP8 per tensor applied, nothing else."""
        from calib.recipe.support.base import Effect as E, Engine, Source, cell_maker, v

        S = Source("example/toyserve", "toy/cache.py", "Cache.load", "1.0")
        ENGINE = Engine("toyserve", "ToyServe", 4, {"gpu": "GPU"}, v("1.0"), "toyserve 1.0", ("toy", "{model}"),
                        "--ctx", "--kv choice", "not a --kv choice", (S,), kv_flag="--kv")
        c = cell_maker(ENGINE)
        CELLS = (c("*", "*", "tensor", E.APPLIED, "applied", S),
                 c("*", "*", ("head", "q_scale", "q_absent", "skip_layers"), E.IGNORED, "one scale, no q, no skip", S))
    '''))
    _edit(pkg / "recipe/dtypes.py", '"trtllm-engine": Served(("FP8",))})', '"trtllm-engine": Served(("FP8",)), '
          '"toyserve": Served(("f8",))})')
    assert _changed(tmp_path) == ["calib/export/toyserve.py", "calib/recipe/dtypes.py",
                                  "calib/recipe/support/engines/toyserve.py"]
    _check(tmp_path, '''
        import itertools
        from calib import verify
        from calib.engine import command
        from calib.export import TARGETS
        from calib.recipe import recipe, support

        assert support.targets()[-1] == "toyserve" and list(TARGETS) == list(support.targets())
        assert "toyserve" in recipe.TARGETS
        for f, b, a in itertools.product(support.KV_FORMATS, ["gpu"], support.ASPECTS):
            support.cell("toyserve", None, b, f, a)          # exactly one cell each
        assert recipe.Recipe(targets=("toyserve",)).targets == ("toyserve",)
        for bad, says in (({"dtype": "int8"}, "ToyServe has no static INT8 KV cache (not a --kv choice)"),
                          ({"skip_layers": (1,)}, "ToyServe cannot skip layers")):
            try:
                recipe.Recipe(targets=("toyserve",), **bad)
                raise SystemExit(f"took {bad}")
            except recipe.RecipeError as err:
                assert says in str(err), err
        assert command.line("toyserve", "m", "fp8_e4m3", max_model_len=8) == "toy m --ctx 8 --kv f8"
        assert TARGETS["toyserve"].serve_command("out") == "toy out --kv f8"
        assert support.outcome("toyserve", support.Calibrated("fp8_e4m3")).severity == support.SAME
        assert list(verify.CHECKERS) == ["vllm", "trtllm", "sglang", "trtllm-engine"]   # checks are optional
        assert "| ToyServe |" in support.markdown()
        print("ok")
    ''')
