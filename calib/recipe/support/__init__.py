"""What each serving engine does with a checkpoint's KV-cache scales: the one support matrix.

Why one package: scales that never reach the kernel are the commonest failure of KV-scale tools, and it is
silent. An engine may apply the scales, apply one max over heads or over K and V, run at scale 1.0, accept a
format it does not implement, or refuse to start; which one depends on the engine, its version, its attention
backend, the KV format, the granularity and (SGLang) the model's architecture. Every command that prints a serve
command or a decision (calibrate, export, verify, eval, tune) reads it from here, so the facts have one home, and
each cell carries where it was read (repository, file, function, version) or the measurement that found it.

Layout: `base` is the vocabulary (Effect, Source, Version, Engine, Cell); `engines/` holds one module per engine
(its `ENGINE` and `CELLS`); `matrix` gathers them and answers lookups (`cell`, `effect`, `targets`, the skip
rules, `markdown` for the README); `outcome` says, for a calibrated result, what an engine does with the file
and whether a command must refuse. Which formats exist, and which engine names which, is calib.recipe.dtypes'.
Torch-free: the recipe, the exporters and the CLI import it before anything heavy. `python -m
calib.recipe.support` prints the README's table.
"""

from __future__ import annotations

from calib.recipe.support.base import ASPECTS, Effect, Measurement, Source, Version
from calib.recipe.support.matrix import (CELLS, DYNAMIC_FORMATS, ENGINES, KV_FORMATS, NOTES, SKIP_KINDS, STATIC_FORMATS,
                                         SupportError, applies, builds, cell, effect, engine, lacks_format, lacks_skip,
                                         markdown, q_scale_readers, skip_by_kind, skip_order, targets, version_of)
from calib.recipe.support.outcome import DIFFERS, REFUSE, SAME, Calibrated, Outcome, outcome, who_serves
