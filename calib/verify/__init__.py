"""Check a checkpoint against the rules vLLM and TensorRT-LLM apply when they load its KV-cache scales.

Works on any producer's layout: kvcalib's two variants, llm-compressor (compressed-tensors, scales
`*.self_attn.{k,v}_scale`, shape [] or [1], [kv_heads, 1, 1] per head), ModelOpt (`hf_quant_config.json`,
`*.self_attn.{k,v}_proj.{k,v}_scale`) and AMD Quark (`quant_method: quark`, `*.{k,v}_proj.output_scale`).
Each rule is a small function whose docstring names the engine file and function it restates; rules
were read from vLLM 0.32 (module paths under `vllm/`) and TensorRT-LLM main as of 2026-12 (paths under
`tensorrt_llm/`). A rule the engine would fail on is an "error"; one that loads but loses precision or
is ignored today is a "warning".

Reads only JSON and safetensors headers/values (calib.ckpt.reader): never unpickles, never imports torch, so it
is fast enough for a pre-deploy check.

Layout: calib.ckpt.reader reads the checkpoint once (and defines `Problem`), `common` holds checks both
engines' rules share, `vllm` and `trtllm` hold each engine's view and rules and define its `CHECKER`
(calib.verify.checker); this module finds the checkers, as calib.export finds targets, picks the engines
and runs their rules. A new engine's checks are one new module here.
"""

from __future__ import annotations

from pathlib import Path

from calib import discovery
from calib.ckpt.reader import CheckpointFiles, Problem
from calib.recipe import support
from calib.verify.checker import Checker


def discover(path: list[str] | None = None, package: str = __name__) -> dict[str, Checker]:
    """The `CHECKER` of every module of this package (or of `package` at `path`), in the targets' order (the
    support matrix's engines; engines without one after them, by name)."""
    rank = {name: i for i, name in enumerate(support.targets())}
    found = discovery.collect(__path__ if path is None else path, package, "CHECKER", Checker)
    return {c.name: c for c in sorted(found, key=lambda c: (rank.get(c.name, len(rank)), c.name))}


CHECKERS: dict[str, Checker] = discover()
ENGINES = tuple(CHECKERS)


def _targets(ck: CheckpointFiles) -> list[str]:
    """Engines the checkpoint is made for: what its configs declare, else what kvcalib.json says, else all."""
    found = [name for name, checker in CHECKERS.items() if checker.declared(ck)]
    target = (ck.provenance or {}).get("target")
    if target in ENGINES and target not in found:
        found.append(target)
    return found or list(ENGINES)


def engines(ckpt: str | Path, engine: str = "all") -> list[str]:
    """The engines `verify(ckpt, engine)` checks."""
    path = Path(ckpt)
    if engine != "all":
        return [engine]
    return _targets(CheckpointFiles(path)) if (path / "config.json").is_file() else []


def verify(ckpt: str | Path, engine: str = "all") -> list[Problem]:
    """Problems an engine would hit loading `ckpt`'s KV-cache scales; [] when none.

    `engine`: one of ENGINES, or "all" (the engines the checkpoint declares itself for; every engine when it
    declares none).
    """
    if engine not in ("all", *ENGINES):
        names = ["'all'", *(f"'{e}'" for e in ENGINES)]
        raise ValueError(f"engine must be {', '.join(names[:-1])} or {names[-1]}, got {engine!r}")
    path = Path(ckpt)
    if not (path / "config.json").is_file():
        return [Problem("checkpoint", str(path), "no config.json: not a checkpoint directory", code="checkpoint.config")]
    ck = CheckpointFiles(path)
    problems = list(ck.read_problems)
    for name in _targets(ck) if engine == "all" else [engine]:
        problems.extend(CHECKERS[name].check(ck))
    return list(dict.fromkeys(problems))
