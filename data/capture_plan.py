"""The capture's plan (data/capture.py): samples sorted by length, packed into batches of
<= `batch_tokens` padded tokens, batches grouped into shards of about `shard_tokens`
tokens. Deterministic, so a rerun after a kill recognises the shards it already wrote.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CapturePlan:
    """shards[k] = list of batches; a batch = list of sample rows (ascending length)."""

    shards: list[list[list[int]]]
    lengths: list[int]

    def shard_tokens(self, k: int) -> int:
        return sum(self.lengths[i] for b in self.shards[k] for i in b)

    def fingerprint(self, extra: dict) -> str:
        return hashlib.sha256(
            json.dumps([self.shards, self.lengths, extra], sort_keys=True).encode()
        ).hexdigest()


def plan_capture(lengths: Sequence[int], batch_tokens: int, shard_tokens: int) -> CapturePlan:
    """Length-bucketed batches (<= batch_tokens padded tokens, at least one sample) grouped
    into shards of >= shard_tokens real tokens (the last may be smaller)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur = [], []
    for i in order:
        # Sorted ascending, so the new sample sets the padded length of the batch.
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    shards, shard, tokens = [], [], 0
    for b in batches:
        shard.append(b)
        tokens += sum(lengths[i] for i in b)
        if tokens >= shard_tokens:
            shards.append(shard)
            shard, tokens = [], 0
    if shard:
        shards.append(shard)
    return CapturePlan(shards=shards, lengths=list(lengths))
