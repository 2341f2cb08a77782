"""arpo_async/jobs/sft.py batching: every trace once per epoch, and length-grouped batches
that carry little padding."""

from __future__ import annotations

import numpy as np
import pytest

from arpo_async.jobs.sft import _Batches


@pytest.mark.parametrize("grouped", [False, True])
def test_each_epoch_uses_every_trace_once_in_full_batches(grouped):
    n, size = 1003, 16
    lengths = np.random.default_rng(1).integers(90, 290, n)
    batches = _Batches(n, size, np.random.default_rng(0), list(lengths) if grouped else None)
    per_epoch = n // size
    for _ in range(2):
        epoch = [batches.next() for _ in range(per_epoch)]
        assert all(len(b) == size for b in epoch)
        seen = np.concatenate(epoch)
        assert len(set(seen.tolist())) == len(seen) == per_epoch * size


def test_grouped_batches_pad_little_and_are_seeded():
    n, size = 3000, 16
    lengths = np.random.default_rng(2).integers(90, 290, n)

    def widths(grouped: bool, seed: int) -> list[int]:
        b = _Batches(n, size, np.random.default_rng(seed), list(lengths) if grouped else None)
        return [int(lengths[b.next()].max()) for _ in range(n // size)]

    mean = lengths.mean()
    assert np.mean(widths(False, 0)) > 1.3 * mean  # random batches: padded to the longest
    assert np.mean(widths(True, 0)) < 1.1 * mean
    assert widths(True, 0) == widths(True, 0) and widths(True, 0) != widths(True, 1)
