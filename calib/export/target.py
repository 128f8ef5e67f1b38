"""What an engine target is: a name, what the engine can read, and a writer over the one `write_variant`.

Adding an engine is one new module in this package that defines `TARGET` (an instance of a `Target`
subclass), beside the engine's module in the support matrix (calib.recipe.support.engines, which makes the name a
target the recipe accepts) and its names for the KV formats it has (calib.recipe.dtypes): calib.export finds the
writer, and the pipeline writes through it. What a target accepts is read from those two, never restated here.
The package imports no torch (the writers import it when they write), so the commands can list targets and stay
light.

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
from calib.engine import command
from calib.provenance import Provenance
from calib.recipe import dtypes as dtypes_mod, support
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
    folds_heads: ClassVar[bool] = False    # writes per-head scales as their max per layer (one scale per layer)

    @property
    def dtypes(self) -> tuple[KVDtype, ...]:
        """The KV dtypes the engine reads scales for: the static formats it has a name for (calib.recipe.dtypes)."""
        return dtypes_mod.for_engine(self.name)

    @property
    def skips_layers(self) -> bool:
        """The engine keeps some layers' KV cache in the model dtype (the support matrix's skip_layers cell)."""
        return not self._known() or support.applies(self.name, "skip_layers")

    @property
    def reads_q_scale(self) -> bool:
        """The engine applies a q_scale (FP8 attention) on some backend (the support matrix's q_scale cell)."""
        return self._known() and support.applies(self.name, "q_scale")

    def _known(self) -> bool:
        return self.name in support.ENGINES      # an engine the matrix does not know: the old defaults

    def serve_command(self, path: str, skip: tuple[int | str, ...] = (), dtype: str = FP8_E4M3.name) -> str:
        """The command that serves the variant at `path` (`skip`: layers kept in the model dtype), from the one
        builder every command uses (calib.engine.command); `path` as given, quoted there where it needs it."""
        return command.line(self.name, path, dtype, skip)

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
