"""What an engine target is: a name, the KV dtypes it serves, and a writer over the one `write_variant`.

Adding an engine is one new module in this package that defines `TARGET` (an instance of a `Target`
subclass); calib.export finds it by that name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..scales import Scales


@dataclass(frozen=True)
class WriteOptions:
    """What a target needs from the recipe and the command line to write its variant."""
    dtype: str = "fp8_e4m3"          # the recipe's KV dtype (calib.quant registry name)
    granularity: str = "tensor"      # the recipe's granularity (calib.granularity registry name)
    force: bool = False              # replace an earlier kvcalib output at OUT
    overwrite_kv: bool = False       # the source carries KV scales already: replace them


class Target:
    """One engine's checkpoint variant. Subclasses set `name` and `dtypes` and implement `write`."""
    name: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]]     # calib.quant names of the KV dtypes the engine reads scales for

    def write(self, source: Path, out: Path, scales: Scales, provenance: dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        raise NotImplementedError
