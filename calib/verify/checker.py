"""What an engine's checks are: how the engine sees a checkpoint (its view), the rules over that view, and
whether a checkpoint declares itself for the engine.

A module of calib.verify that defines `CHECKER` is an engine's checks, found as calib.export finds a `TARGET`:
an engine whose loader rules kvcalib knows is one more file here. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from calib.ckpt.reader import CheckpointFiles, Problem


@dataclass(frozen=True)
class Checker:
    name: str                                                    # the engine (an export target's name)
    view: Callable[[CheckpointFiles], Any]                       # what the engine reads of the checkpoint
    rules: tuple[Callable[[CheckpointFiles, Any], Iterable[Problem]], ...]   # one per loader check
    declared: Callable[[CheckpointFiles], bool]                  # the checkpoint's configs name this engine

    def check(self, ck: CheckpointFiles) -> list[Problem]:
        """Every rule's problems over one view of `ck`."""
        view = self.view(ck)
        return [p for rule in self.rules for p in rule(ck, view)]
