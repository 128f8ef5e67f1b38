"""What an engine target is: a name, what the engine can read, and a writer over the one `write_variant`.

Adding an engine is one new module in this package that defines `TARGET` (an instance of a `Target`
subclass): calib.export finds it, the recipe accepts its name and checks a recipe against what it declares
(KV dtypes, skipped layers, q_scale), and the pipeline writes through it. The package imports no torch (the
writers import it when they write), so the recipe can read these declarations and stay light.

Two steps, so that a source the engine cannot take is refused before any model loads: `prepare` checks the
source checkpoint against what this engine's variant needs (no scales, no weights read: config and headers
only) and returns the `PreparedSource` that `write` then writes from. The calibrate and export checks run
`prepare` for every requested target and hand its result to `write`; each engine checks its own rules (a
ModelOpt source is fine for TensorRT-LLM and refused for vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from calib.ckpt.source import PreparedSource, SourceFiles, check_out_is_not_source, read_source, scan_weights
from calib.provenance import Provenance
from calib.recipe.dtypes import FP8_E4M3, KVDtype
from calib.recipe.granularity import Granularity, PerTensor

if TYPE_CHECKING:
    from calib.scales.fold import Scales


@dataclass(frozen=True)
class WriteOptions:
    """What a target needs from the recipe and the command line to write its variant."""
    dtype: KVDtype = FP8_E4M3              # the recipe's KV dtype (calib.recipe.dtypes)
    granularity: Granularity = PerTensor()  # the recipe's granularity (calib.recipe.granularity)
    force: bool = False                    # replace an earlier kvcalib output at OUT
    overwrite_kv: bool = False             # the source carries KV scales already: replace them
    extra_files: dict[str, str] | None = None   # {name: text} written beside the checkpoint in the same step
    into: bool = False                     # the source is a weight-quantized checkpoint given as --into


class Target:
    """One engine's checkpoint variant. Subclasses set the class attributes and implement `write`."""
    name: ClassVar[str]
    order: ClassVar[int]                   # place in listings and messages
    dtypes: ClassVar[tuple[KVDtype, ...]]  # the KV dtypes the engine reads scales for
    dtype_note: ClassVar[str] = ""         # why another dtype is refused, and what to do instead
    skips_layers: ClassVar[bool] = True    # can keep some layers' KV cache in the model dtype
    skip_note: ClassVar[str] = ""          # why it cannot, and what to do instead
    reads_q_scale: ClassVar[bool] = False  # reads a q_scale (FP8 attention)
    q_note: ClassVar[str] = ""             # who reads q_scale, for the message when no target does

    def prepare(self, source: Path | SourceFiles, out: Path, options: WriteOptions = WriteOptions()) -> PreparedSource:
        """Check `source` for this engine's variant before anything is computed or written (ExportError naming
        the file and the fix); what `write` writes from. The default: the output is not the source, config.json
        is strict JSON, every shard header is sound, and the source carries no tensors of its own to drop."""
        files = read_source(source)
        check_out_is_not_source(files.path, out)
        return scan_weights(files, files.config, lambda name: False)

    def write(self, source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        """Write the variant to `out` from what `prepare` returned (a path is prepared first)."""
        raise NotImplementedError
