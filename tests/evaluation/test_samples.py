"""Held-out sample selection: length buckets within the model's context."""

from __future__ import annotations

from calib.evaluation.samples import usable_buckets


def test_buckets_beyond_the_context_are_dropped():
    assert usable_buckets([8192, 512, 2048], 4096) == ((512, 2048), [8192])
    assert usable_buckets([8192], 1024) == ((1024,), [8192])
    assert usable_buckets([64, 16], None) == ((16, 64), [])
