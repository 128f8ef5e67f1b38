"""What an engine target is: a name, what the engine can read, and a writer over the one `write_variant`.

Adding an engine is one new module in this package that defines `TARGET` (an instance of a `Target`
subclass): calib.export finds it, the recipe accepts its name and checks a recipe against what it declares
(KV dtypes, skipped layers, q_scale), and the pipeline writes through it. The package imports no torch (the
writers import it when they write), so the recipe can read these declarations and stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

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

    def write(self, source: Path, out: Path, scales: Scales, provenance: dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        raise NotImplementedError
