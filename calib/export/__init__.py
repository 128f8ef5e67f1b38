"""Write a checkpoint that an engine loads with our KV scales; the source weights are never rewritten.

One module per engine target (`vllm`, `trtllm`), each a small `Target` over the one `write_variant`
(`write`); the layout they write — file and tensor names, config blocks, the source's weight map — is
calib.ckpt's. A module of this package that defines `TARGET` is an engine target: adding an engine is one
new file here; the recipe takes its name and its rules (calib.export.target) from `TARGETS`. Each target
checks a source with its own `prepare` (what one engine accepts another may refuse: there is no generic
source check here beyond calib.ckpt.source's). Imports no
torch: the writers import it when they write.
"""

from __future__ import annotations

from calib import discovery
from calib.ckpt.names import INDEX_FILE, PROVENANCE_FILE, SCALES_FILE
from calib.ckpt.source import ExportError, PreparedSource, SourceFiles, read_source, scan_source
from calib.export.target import Target, WriteOptions
from calib.export.trtllm import export_trtllm
from calib.export.vllm import export_vllm, vllm_quantization_config


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


__all__ = ["ExportError", "INDEX_FILE", "PROVENANCE_FILE", "PreparedSource", "SCALES_FILE", "SourceFiles", "TARGETS",
           "WriteOptions", "discover", "export_trtllm", "export_vllm", "read_source", "scan_source", "target",
           "vllm_quantization_config"]
