"""The evaluation's report: report.json, report.md and the plots of a finished evaluation.

Why a module apart from the verdict (calib/evaluation/verdict.py): the verdict decides from typed numbers; the
report only writes them down — every arm's numbers, whether it is within the threshold and why not, and the
verdict — so the file format changes without touching a decision.

Outputs (written to a temporary sibling directory, renamed into place when complete): report.json (schema
`kvcalib.eval/1`; every number; non-finite values such as the SNR of an exact arm are null), report.md (the
decision, its table and serve command first, then the tables and verdict: calib/evaluation/markdown.py) and PNG
plots (matplotlib, Agg backend; skipped with a note when matplotlib is missing).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from calib.evaluation import engine_report, significance
from calib.evaluation import formats as kv_formats
from calib.evaluation import markdown as render
from calib.evaluation import plots as plots_mod
from calib.evaluation.results import ArmMetrics, Reference
from calib.engine import command
from calib.errors import KvcalibError
from calib.recipe.dtypes import MODEL_DTYPE_BYTES
from calib.evaluation.verdict import Thresholds, Verdict, failures, passkey_decision
from calib.safety import files

PLOTS = plots_mod.PLOTS
SCHEMA = "kvcalib.eval/1"          # report.json's format: a key renamed, moved or retyped takes the next number


def declared_dtype(model: str | Path) -> str | None:
    """The dtype a model folder's config.json declares (`dtype`, else `torch_dtype`; a multimodal model's
    text_config first): the dtype an engine serves it in (`auto`), whatever kvcalib loaded it in. A hub id is read
    from the local Hugging Face cache only; None where no config is at hand or it declares none."""
    path = Path(model) / "config.json"
    if not path.is_file() and not os.path.isabs(str(model)) and str(model).count("/") == 1:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(model), "config.json")
            path = Path(cached) if isinstance(cached, str) else path
        except (ImportError, ValueError):
            pass
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg.get("text_config"), cfg) if isinstance(cfg, dict) else ():
        declared = (c.get("dtype") or c.get("torch_dtype")) if isinstance(c, dict) else None
        if isinstance(declared, str):       # a model dtype kvcalib knows, else nothing (the file is the user's input)
            name = declared.removeprefix("torch.")
            return name if name in MODEL_DTYPE_BYTES else None
    return None


@dataclass(frozen=True)
class Report:
    """What report.json and report.md show: the run's description (`meta`: model, data, buckets, settings,
    notes, emulation, engine), the reference's and every arm's numbers, the thresholds and the verdict."""
    meta: Mapping[str, Any]
    reference: Reference
    arms: Mapping[str, ArmMetrics]
    thresholds: Thresholds
    verdict: Verdict

    @property
    def reference_name(self) -> str:
        return self.meta["reference"]

    def misses(self, name: str) -> list[str]:
        return failures(self.arms[name], self.reference, self.thresholds)

    @property
    def serving_dtype(self) -> str:
        """The dtype the model is served in without KV quantization: its config.json's (an engine's `auto`), else
        the dtype it was measured in (kvcalib loads float32 on CPU: the reference is then FP32, the model BF16), else
        the reference's name."""
        model = self.meta.get("model")
        return (declared_dtype(model) if model else None) or self.meta.get("model_dtype") or self.reference_name

    def serve_argv(self) -> list[str] | None:
        return serve_argv(self.verdict, self.arms, str(self.meta["model"]), self.meta.get("config", {}).get("target"))

    def within(self, name: str) -> bool:
        return self.arms[name].info.shippable and not self.misses(name)

    def formats(self) -> kv_formats.FormatChoice | None:
        """The KV format to serve by bytes per token (calib/evaluation/formats.py), when the run has whole-format
        arms (`--formats`); None otherwise."""
        if not any(e.info.kind == "format" for e in self.arms.values()):
            return None
        m = self.meta
        return kv_formats.choose(self.arms, lambda e: failures(e, self.reference, self.thresholds),
                                 m["model_dtype"], m["kv_heads"], m["head_dim"], self.reference_name, len(m["layers"]))

    def passkey(self, name: str) -> significance.PasskeyDecision | None:
        return passkey_decision(self.arms[name], self.reference, self.thresholds)

    def to_dict(self) -> dict[str, Any]:
        """report.json: the description, every arm's numbers with whether it is within the threshold and why
        not, and the verdict."""
        arms = {n: {**e.to_dict(), "within_threshold": self.within(n), "misses": self.misses(n),
                    **({"passkey_significance": pk.to_dict()} if (pk := self.passkey(n)) is not None else {})}
                for n, e in self.arms.items()}
        fmt = self.formats()
        arms = {self.reference_name: self.reference.to_dict(), **arms}
        return {"schema": SCHEMA, **self.meta, "serving_dtype": self.serving_dtype,
                "thresholds": self.thresholds.to_dict(), "arms": arms,
                "verdict": self.verdict.to_dict(), **({"formats": fmt.to_dict()} if fmt else {})}


def serve_argv(v: Verdict, arms: Mapping[str, ArmMetrics], model: str, target: str | None) -> list[str] | None:
    """The whole command that serves verdict `v` (calib.engine.command, the builder every command uses): the shipped
    arm's checkpoint or the model with its KV dtype and skipped layers, else the model as it is; on `target`'s
    engine (vLLM without one). None where the decision is served otherwise (scales still to calibrate) or the
    engine has no flag for it."""
    dtype, skip = None, []
    if v.action in render.SHIPS and v.arm is not None:
        info = arms[v.arm].info
        if info.kind not in ("checkpoint", "default", "format"):
            return None
        model = str(info.source) if info.kind == "checkpoint" else model
        dtype = info.dtype
        skip = v.flag.split()[1:] if v.action == "ship_with_skip" and v.flag else [*info.serve_skip, *info.skip]
    try:
        return command.argv(target or "vllm", model, dtype, skip)
    except KvcalibError:
        return None


def finite(x: Any) -> Any:
    """JSON without NaN/Infinity (strict readers refuse them): non-finite numbers become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write(out: Path, rep: Report, *, force: bool, plots: bool = True) -> dict[str, Any]:
    """report.json, report.md and the plots into `out`, atomically (refuses an existing `out` unless force);
    returns report.json's document."""
    from calib.safety.outputs import atomic_dir

    with atomic_dir(out, force, kind="eval report") as tmp:
        made, note = plots_mod.plot_all(rep, tmp) if plots else ([], "plots not requested")
        if note:
            rep = replace(rep, meta={**rep.meta, "notes": [*rep.meta.get("notes", []), note]})
        doc = rep.to_dict()
        extra = engine_report.plot(doc, tmp) if plots and made else None
        made = [*made, extra] if extra else made
        files.write_text(tmp / "report.json", json.dumps(finite(doc), indent=2, allow_nan=False) + "\n")
        files.write_text(tmp / "report.md", render.markdown(rep, doc, made))
    return doc
