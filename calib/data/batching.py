"""Turn a stream of token sequences into padded batches, cheaply and ahead of the model.

Why: calibration should cost one forward pass over the real tokens. Padding (a batch is as wide as its longest
sequence) and waiting for the CPU to tokenize the next batch inflate it: length bucketing within a bounded
window keeps padding small without holding the dataset in memory, and a background thread prepares the next
batches. Neither changes a statistic: padding is masked out and absmax does not depend on order.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PaddingStats:
    """Real vs. padded token counts of the batches produced so far."""
    real: int = 0
    total: int = 0

    @property
    def fraction(self) -> float:
        """Share of computed positions that were padding (0.0 = none)."""
        return 0.0 if self.total == 0 else 1.0 - self.real / self.total


def pad(group: list[list[int]], pad_id: int = 0) -> Batch:
    """Right-padded `(input_ids, attention_mask)`. Right padding keeps every real token at its true position,
    and causal attention never lets a real token see the padding after it."""
    width = max(len(s) for s in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, s in enumerate(group):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


def batches(seqs: Iterable[list[int]], batch_size: int, pad_id: int = 0, *, max_batch_tokens: int | None = None,
            window: int = 256, padding: PaddingStats | None = None) -> Iterator[Batch]:
    """Batches of at most `batch_size` sequences, in stream order; with `max_batch_tokens`, windows of `window`
    sequences sorted by length and cut into batches whose padded size (rows × longest) stays within it."""
    def emit(group: list[list[int]]) -> Batch:
        ids, mask = pad(group, pad_id)
        if padding is not None:
            padding.real += int(mask.sum())
            padding.total += mask.numel()
        return ids, mask

    it = iter(seqs)
    while group := list(itertools.islice(it, batch_size if max_batch_tokens is None else window)):
        yield from map(emit, [group] if max_batch_tokens is None else
                       _budget_groups(group, batch_size, max_batch_tokens))


def _budget_groups(buf: list[list[int]], batch_size: int, budget: int) -> Iterator[list[list[int]]]:
    group: list[list[int]] = []
    for s in sorted(buf, key=len, reverse=True):
        width = max(len(group[0]) if group else 0, len(s))
        if group and ((len(group) + 1) * width > budget or len(group) == batch_size):
            yield group
            group = []
        group.append(s)
    if group:
        yield group


_DONE = object()


def prefetch(items: Iterable, depth: int = 2) -> Iterator:
    """Yield `items` while a background thread produces the next `depth` of them; errors are re-raised
    here, in the consumer, and the thread stops when the consumer stops early."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((_DONE, None))
        except BaseException as e:  # surfaced in the consumer
            q.put((_DONE, e))

    t = threading.Thread(target=work, name="kvcalib-prefetch", daemon=True)
    t.start()
    try:
        while True:
            item, err = q.get()
            if item is _DONE:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        t.join(timeout=5)
