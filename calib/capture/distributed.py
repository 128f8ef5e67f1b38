"""Data-parallel calibration under `torchrun`: each rank runs its share of the batches, ranks merge observers.

Why batches and not samples are sharded: every rank builds the same batch sequence and runs batches `i` with
`i % world == rank`, each computed exactly as one process would, so the merged maxima are bit-identical to a
one-process run (sharded samples would regroup into other batches, and GEMMs round differently for other
shapes). The merged statistics exist on every rank; only rank 0 writes the checkpoint.

    torchrun --nproc-per-node 8 -m calib.cli calibrate --model M --data D --out OUT
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 -m calib.cli calibrate ...
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env() -> Dist:
    """The process group torchrun describes in the environment (initialised here), or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    import torch.distributed as td

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not td.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        td.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(rank=td.get_rank(), world=td.get_world_size(), local_rank=local)


def device_for(dist: Dist, requested: str | None) -> str | None:
    """Each rank takes its own GPU (cuda:LOCAL_RANK) unless a device was given explicitly."""
    if requested or dist.world == 1 or not torch.cuda.is_available():
        return requested
    return f"cuda:{dist.local_rank}"


def shard(batches: Iterable[Any], dist: Dist) -> Iterator[Any]:
    """This rank's batches: every `world`-th one, starting at `rank`."""
    return itertools.islice(batches, dist.rank, None, dist.world)


def merge_all(local: dict[int, Any], dist: Dist) -> dict[int, Any]:
    """Gather every rank's per-layer observers and merge them in rank order (same result on every rank)."""
    if dist.world == 1:
        return local
    import torch.distributed as td

    gathered: list[dict[int, Any] | None] = [None] * dist.world
    td.all_gather_object(gathered, {i: obs.to_cpu() for i, obs in local.items()})
    merged = gathered[0]
    for other in gathered[1:]:
        for i, obs in other.items():
            merged[i].merge(obs)
    return merged


def barrier(dist: Dist) -> None:
    if dist.world > 1:
        import torch.distributed as td

        td.barrier()
