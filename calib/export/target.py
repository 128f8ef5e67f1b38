"""What an engine target is: a name, the KV dtypes it serves, and a writer over the one `write_variant`.

Adding an engine is one new module in this package that defines `TARGET` (an instance of a `Target`
subclass); calib.export finds it by that name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..granularity import Granularity, PerTensor
from ..scales import Scales
from ..vocab import FP8_E4M3, KVDtype


@dataclass(frozen=True)
class WriteOptions:
    """What a target needs from the recipe and the command line to write its variant."""
    dtype: KVDtype = FP8_E4M3              # the recipe's KV dtype (calib.vocab)
    granularity: Granularity = PerTensor()  # the recipe's granularity (calib.granularity)
    force: bool = False              # replace an earlier kvcalib output at OUT
    overwrite_kv: bool = False       # the source carries KV scales already: replace them
    extra_files: dict[str, str] | None = None   # {name: text} written beside the checkpoint in the same step


class Target:
    """One engine's checkpoint variant. Subclasses set `name` and `dtypes` and implement `write`."""
    name: ClassVar[str]
    dtypes: ClassVar[tuple[KVDtype, ...]]     # the KV dtypes the engine reads scales for

    def write(self, source: Path, out: Path, scales: Scales, provenance: dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        raise NotImplementedError
