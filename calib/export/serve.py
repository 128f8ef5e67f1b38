"""What each target's engine will do with what kvcalib writes, read from the support matrix; the refusal
before anything is written; the serve lines every command prints.

Why: a checkpoint an engine loads but whose scales it never applies is the silent failure users of KV-scale
tools meet most. So every command that writes or names a checkpoint for an engine asks the one support
matrix (calib.recipe.support) what that engine does with it, says so next to the serve command, and refuses
— one line naming the engine, its version and what to do instead, before any output exists — where the
engine would run the scales at 1.0 and that changes the result (INT8 at 1.0; FP8 with values past its range),
or would not run the file at all. `--engine-version ENGINE=VERSION` states another version or a build (e.g.
`trtllm=pr18953`, TensorRT-LLM with calibrated INT8 KV) and the matrix answers for it. Where the engine's
loading depends on the model (SGLang drops the scales of some architectures), the model's architecture is read
from the written checkpoint's config.json and the serve lines warn. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from calib.ckpt.source import ExportError
from calib.recipe import support


def parse_versions(text: str | None, targets: Sequence[str]) -> dict[str, str]:
    """`--engine-version`: `ENGINE=VERSION[,ENGINE=VERSION]`, or a bare VERSION when there is one target; the one
    grammar of every command (calibrate, export, verify, eval). Each engine once, each one of `targets`, each version
    one the support matrix parses (numbers, +BUILD, or a bare build label)."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in (text or "").split(",")):
        if not item:
            continue
        name, eq, version = item.partition("=")
        if not eq:
            if len(targets) != 1:
                raise ExportError(f"--engine-version {item!r}: name the engine (e.g. trtllm={item}) when there are "
                                  f"several targets ({', '.join(targets)})")
            name, version = targets[0], item
        name, version = name.strip(), version.strip()
        if name not in support.ENGINES:
            raise ExportError(f"--engine-version {item!r}: unknown engine {name!r}; known: {', '.join(support.ENGINES)}")
        if name not in targets:
            raise ExportError(f"--engine-version {item!r}: {name} is not a target here ({', '.join(targets) or 'none'}); "
                              "state versions only of the engines you serve with")
        if name in out:
            raise ExportError(f"--engine-version {item!r}: {name} is given twice ({name}={out[name]} too); give one "
                              "version per engine")
        try:
            support.version_of(name, version)
        except ValueError as e:
            raise ExportError(f"--engine-version {item!r}: {e}") from None
        out[name] = version
    return out


def architecture_of(path: str | Path) -> str | None:
    """The model architecture a checkpoint folder declares (config.json `architectures[0]`); None when unread."""
    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def outcomes(recipe: Any, scales: Mapping[int, Any] | None = None, skipped: Iterable[int | str] | None = None,
             versions: Mapping[str, str] | None = None,
             architecture: str | None = None) -> dict[str, support.Outcome]:
    """{target: what its engine does with the recipe's result}; `scales` (when known) give the range ratio,
    `skipped` the resolved skipped layers (the recipe's own entries when not yet resolved), `architecture` the
    model's (config.json `architectures[0]`; None: not known, the engine's rule for any model)."""
    from calib.export import TARGETS

    skip = tuple(support.skip_order(recipe.skip_layers if skipped is None else skipped))
    # the largest |K| or |V| over every layer and head, over the format's largest value
    ratio = max(max(float(s.k_amax.max()), float(s.v_amax.max())) for s in scales.values()) / recipe.kv_dtype.qmax \
        if scales else None
    out = {}
    for name in recipe.targets:
        t = TARGETS[name]      # what it writes: per-head scales folded where it folds them, q_scale where it writes one
        gran = "tensor" if getattr(t, "folds_heads", False) else recipe.scale_granularity.name
        cal = support.Calibrated(recipe.kv_dtype.name, gran, bool(recipe.q_scale and t.reads_q_scale), skip, ratio,
                                 architecture)
        out[name] = support.outcome(name, cal, (versions or {}).get(name))
    return out


def for_model(outcome: support.Outcome, architecture: str | None) -> support.Outcome:
    """`outcome` again for a model of `architecture` (the same when None or already known)."""
    if architecture is None or outcome.calibrated.architecture is not None:
        return outcome
    return support.outcome(outcome.engine, replace(outcome.calibrated, architecture=architecture), outcome.version,
                           [c.backend for c in outcome.per_backend])


def instead(name: str, outcome: support.Outcome) -> str:
    """What to do instead of serving a refused result on `name`: engines that serve it as calibrated, and a
    build of this engine that applies it (a build-specific cell of the matrix)."""
    cal = outcome.calibrated
    others = [e for e in support.ENGINES if e != name and support.outcome(e, cal).severity == support.SAME]
    parts = []
    if others:
        parts.append(f"use --target {' or '.join(others)}, which {'applies' if len(others) == 1 else 'apply'} these scales")
    elif cal.dtype != "fp8_e4m3":
        fp8 = [support.ENGINES[e].title for e in support.ENGINES
               if support.outcome(e, replace(cal, dtype="fp8_e4m3")).severity == support.SAME]
        parts.append(f"calibrate fp8_e4m3 for {' or '.join(fp8)}")
    parts += [f"state a build that applies them with --engine-version {name}={b}"
              for b in support.builds(name, cal.dtype)]
    text = "; or ".join(parts)
    return text[:1].upper() + text[1:]


def check(recipe: Any, scales: Mapping[int, Any] | None = None, skipped: Iterable[int | str] | None = None,
          versions: Mapping[str, str] | None = None, architecture: str | None = None) -> dict[str, support.Outcome]:
    """`outcomes`, or an ExportError (one line) for the first target whose engine would not serve the result."""
    found = outcomes(recipe, scales, skipped, versions, architecture)
    for name, o in found.items():
        if o.refused:
            raise ExportError(o.refusal(instead(name, o)))
    return found


def serve_lines(target: Any, path: str, outcome: support.Outcome, skipped: Sequence[int | str] = ()) -> list[str]:
    """The serve command for `target`'s variant at `path`, and (when the engine applies the scales as
    calibrated) that it does; what differs is `warnings`', except what differs only for this model (its
    config.json architecture, e.g. SGLang dropping a Qwen2's scales), which is warned here."""
    command = target.serve_command(path, tuple(skipped), outcome.calibrated.dtype)
    lines = [f"serve it with {support.ENGINES[target.name].title}:", f"  {command}"]
    if outcome.severity != support.SAME:
        return lines
    mine = for_model(outcome, architecture_of(path))
    if mine.severity != support.SAME:
        return lines + [f"  warning: for {mine.calibrated.architecture}: {line}" for line in mine.lines()]
    return lines + [f"  {outcome.summary()}"]


def warnings(target: Any, recipe: Any, outcome: support.Outcome) -> list[str]:
    """One line per way the engine serves the result differently from what was calibrated; and one where `target`
    writes per-head scales as their max per layer, saying what its engine would do with per-head scales (the
    matrix's `head` cell), e.g. SGLang runs them at 1.0."""
    out = outcome.lines() if outcome.severity != support.SAME else []
    if getattr(target, "folds_heads", False) and recipe.scale_granularity.name == "head":
        e = support.ENGINES[target.name]
        c = support.cell(target.name, outcome.version, next(iter(e.backends)), recipe.kv_dtype.name, "head")
        out.append(f"per-head scales on {e.title} {outcome.version}: {c.effect.value} ({c.note}); the {target.name} "
                   "variant carries their max per layer instead")
    return out
