"""Write a checkpoint that an engine loads with our KV scales; the source weights are never rewritten.

One module per engine target, each defining `TARGET` (what a target is, and how to add one: calib.export.target),
a small writer over the one `write_variant` (`write`); the layout they write is calib.ckpt's. Imports no torch.
"""

from __future__ import annotations

from calib import discovery
from calib.ckpt.formats import ct_quantization_config as vllm_quantization_config
from calib.ckpt.names import INDEX_FILE, PROVENANCE_FILE, SCALES_FILE
from calib.ckpt.source import ExportError, PreparedSource, SourceFiles, read_source, scan_source
from calib.export.target import Target, WriteOptions
from calib.export.trtllm import export_trtllm
from calib.export.vllm import export_vllm


def discover(path: list[str] | None = None, package: str = __name__) -> dict[str, Target]:
    """The `TARGET` of every module of this package (or of `package` at `path`), in their `order`."""
    found = discovery.collect(__path__ if path is None else path, package, "TARGET", Target)
    return {t.name: t for t in sorted(found, key=lambda t: (t.order, t.name))}


TARGETS: dict[str, Target] = discover()


def target(name: str) -> Target:
    """The engine target called `name`; ExportError naming the known ones otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ExportError(f"unknown target {name!r}; kvcalib writes {sorted(TARGETS)}") from None
