"""Batches of samples by padded size: a batch holds samples whose longest times their count
fits a token budget. Training plans its micro-batches this way (train/batching.py) and the
hf regeneration its decoding batches (data/regenerate.py), where left padding makes every
row as long as the batch's longest prompt."""

from __future__ import annotations

from collections.abc import Sequence


def pack_group(
    indices: Sequence[int], lengths: Sequence[int], batch_tokens: int, max_batch_size: int
) -> list[list[int]]:
    """Greedy packing of one group sorted by length (longest first): a batch grows while
    `longest × (count + 1) <= batch_tokens` and count < max_batch_size. A sample longer
    than `batch_tokens` gets a batch of its own."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches, cur, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and (max(longest, n) * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches
