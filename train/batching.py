"""Length-bucketed training batches, deterministic under the seed and resumable by position.

A *plan* is the list of micro-batches of one epoch, each a list of sample indices whose
padded size (longest sample × count) fits `batch_tokens`. Samples are bucketed inside
groups: a feature-cache shard (its samples are already length-sorted and one shard stays in
memory, so a batch never reads two shards) or, for the prepared dataset, seeded chunks of
the shuffled split. The order of groups and of batches inside a group is shuffled with
`seed + epoch`, so epoch e of a run is the same list on every restart: the data position
`(epoch, batches consumed)` is all a checkpoint needs.

With `train.packing` a micro-batch is one *row*: samples of a group concatenated up to
`batch_tokens` (best-fit over the group's lengths, longest first; a longer sample gets a
row of its own), collated with `segments`, the per-slot sample index core/segments.py
reads (DESIGN §3). The plan, its shuffle and the data position are the same otherwise.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from eyas.core.length_batches import pack_group


def pack_rows(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Best-fit decreasing packing of one group into rows of at most `batch_tokens` tokens
    (`train.packing`): longest sample first, each into the fullest row it still fits, else
    a new row; a sample longer than `batch_tokens` gets a row of its own. A row lists its
    samples in the order they are concatenated."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), ascending
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
            rows[r].append(i)
            bisect.insort(free, (room - n, r))
        else:
            rows.append([i])
            if n < batch_tokens:
                bisect.insort(free, (batch_tokens - n, len(rows) - 1))
    return rows


def group_batches(
    indices: Sequence[int], lengths: Sequence[int], batch_tokens: int, max_batch_size: int, packed: bool
) -> list[list[int]]:
    """The micro-batches of one group, unshuffled: packed rows (`pack_rows`) or bucketed
    batches (`pack_group`)."""
    if packed:
        return pack_rows(indices, lengths, batch_tokens)
    return pack_group(indices, lengths, batch_tokens, max_batch_size)


def plan_epoch(
    lengths: Sequence[int],
    groups: Sequence[Sequence[int]],
    batch_tokens: int,
    max_batch_size: int,
    seed: int,
    epoch: int,
    multiple_of: int = 1,
    packed: bool = False,
) -> list[list[int]]:
    """The micro-batches of one epoch (lists of sample indices; with `packed`, each one row
    of `pack_rows`). The count is cut down to a multiple of `multiple_of` (world size ×
    grad accumulation) so every rank runs the same number of optimizer steps."""
    rng = random.Random(seed * 1_000_003 + epoch)
    group_order = list(range(len(groups)))
    rng.shuffle(group_order)
    plan: list[list[int]] = []
    for g in group_order:
        batches = group_batches(groups[g], lengths, batch_tokens, max_batch_size, packed)
        rng.shuffle(batches)
        plan.extend(batches)
    return plan[: len(plan) - len(plan) % multiple_of] if multiple_of > 1 else plan


def dataset_groups(n: int, seed: int, group_size: int) -> list[list[int]]:
    """Seeded chunks of a shuffled range(n): buckets for data without shards."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i : i + group_size] for i in range(0, n, group_size)]


def cache_groups(cache) -> list[list[int]]:
    """One group per feature-cache shard."""
    groups: dict[int, list[int]] = {}
    for i in range(len(cache)):
        groups.setdefault(cache.shard_of(i), []).append(i)
    return [groups[k] for k in sorted(groups)]


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """[B, T, ...] -> the same shape with x[:, n:] moved to the front and `fill` after (the
    teacher-forced tokens of a later TTT step)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def collate(samples: list[dict], pad_id: int = 0, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad samples to the longest, rounded up to a multiple of `pad_to_multiple_of`.
    Each sample holds input_ids [T] and loss_mask [T], and optionally aux [T, n·Ht] /
    last [T, Ht]. Returns input_ids, attention_mask, loss_mask [B, T] (long) and
    aux [B, T, n·Ht] / last [B, T, Ht] when present."""
    b = len(samples)
    t = max(len(s["input_ids"]) for s in samples)
    t = round_up(t, pad_to_multiple_of)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    am = torch.zeros(b, t, dtype=torch.long)
    lm = torch.zeros(b, t, dtype=torch.long)
    out = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
    for key in ("aux", "last"):
        if key in samples[0]:
            ref = samples[0][key]
            out[key] = ref.new_zeros(b, t, ref.shape[-1])
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[r, :n] = torch.as_tensor(s["input_ids"], dtype=torch.long)
        am[r, :n] = 1
        lm[r, :n] = torch.as_tensor(s["loss_mask"], dtype=torch.long)
        for key in ("aux", "last"):
            if key in out:
                out[key][r, :n] = s[key]
    return out


def collate_packed(samples: list[dict], pad_id: int = 0, pad_to_multiple_of: int = 1) -> dict:
    """One packed row (`train.packing`): the samples concatenated in order, then padded as
    `collate` pads; adds `segments` [1, T] long, the sample index of each slot (-1 on
    padding). Offline features are stored per sample, so their concatenation is exact."""
    row = {
        key: torch.cat([torch.as_tensor(s[key]) for s in samples])
        for key in ("input_ids", "loss_mask", "aux", "last")
        if key in samples[0]
    }
    out = collate([row], pad_id, pad_to_multiple_of)
    segments = torch.full_like(out["input_ids"], -1)
    at = 0
    for k, s in enumerate(samples):
        segments[0, at : at + len(s["input_ids"])] = k
        at += len(s["input_ids"])
    out["segments"] = segments
    return out


@dataclass(frozen=True)
class Packing:
    """How a run packs samples into micro-batches, built once from `train.*` (`from_train`)
    and handed whole to every stream."""

    batch_tokens: int
    max_batch_size: int
    seed: int
    multiple_of: int = 1  # an epoch's micro-batches per rank: a multiple of this (grad_accum)
    pad_to_multiple_of: int = 1
    packed: bool = False  # train.packing: a micro-batch is one row of concatenated samples

    @classmethod
    def from_train(cls, train_cfg) -> Packing:
        return cls(
            batch_tokens=train_cfg.batch_tokens,
            max_batch_size=train_cfg.max_batch_size,
            seed=train_cfg.seed,
            multiple_of=train_cfg.grad_accum,
            pad_to_multiple_of=train_cfg.pad_to_multiple_of,
            packed=train_cfg.packing,
        )


@dataclass
class DataPosition:
    """Where the loader stands: `batches` micro-batches of epoch `epoch` are consumed
    (counted over all ranks)."""

    epoch: int = 0
    batches: int = 0

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "batches": self.batches}


class BatchStream:
    """Endless stream of collated micro-batches for one rank, epoch after epoch.

    `source[i]` returns a sample dict (a FeatureCache, or a prepared `datasets.Dataset`
    row). Rank r of `world` takes micro-batches r, r + world, ... of each epoch plan.
    """

    def __init__(
        self,
        source,
        lengths: Sequence[int],
        groups: Sequence[Sequence[int]],
        packing: Packing,
        rank: int = 0,
        world: int = 1,
        pad_id: int = 0,
        position: DataPosition | None = None,
    ):
        self.source, self.lengths, self.groups = source, list(lengths), groups
        self.packing = packing
        self.rank, self.world = rank, world
        self.multiple_of = max(1, packing.multiple_of) * world
        self.pad_id = pad_id
        self.position = position or DataPosition()
        self._plan_epoch: int | None = None
        self._plan: list[list[int]] = []
        self.last_index = (0, 0)  # (epoch, index in the epoch plan) of the last batch returned

    def plan(self, epoch: int) -> list[list[int]]:
        if self._plan_epoch != epoch:
            p = self.packing
            self._plan = plan_epoch(
                self.lengths,
                self.groups,
                p.batch_tokens,
                p.max_batch_size,
                p.seed,
                epoch,
                self.multiple_of,
                p.packed,
            )
            self._plan_epoch = epoch
            if not self._plan:
                raise ValueError(
                    f"no batch fits: {len(self.lengths)} samples cannot fill {self.multiple_of} "
                    "micro-batches (lower train.batch_tokens, grad_accum or the process count)"
                )
        return self._plan

    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch over all ranks."""
        return len(self.plan(self.position.epoch))

    def tokens_per_epoch(self) -> int:
        return sum(self.lengths[i] for b in self.plan(self.position.epoch) for i in b)

    def limit(self, batches: int | None) -> None:
        """How many more batches will be read: nothing is read ahead here, so unused."""

    def close(self) -> None:
        """Nothing to release (train/engine_feed.py's stream has)."""

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        plan = self.plan(self.position.epoch)
        if self.position.batches >= len(plan):
            self.position = DataPosition(self.position.epoch + 1, 0)
            plan = self.plan(self.position.epoch)
        indices = plan[self.position.batches + self.rank]
        self.last_index = (self.position.epoch, self.position.batches + self.rank)
        self.position = DataPosition(self.position.epoch, self.position.batches + self.world)
        join = collate_packed if self.packing.packed else collate
        batch = join([self._sample(i) for i in indices], self.pad_id, self.packing.pad_to_multiple_of)
        # the samples' indices in `source`, in the order of core/segments.py's `sample_spans`
        batch["index"] = torch.tensor(indices, dtype=torch.long)
        return batch

    def _sample(self, i: int) -> dict:
        row = self.source[i]
        return (
            row
            if isinstance(row.get("input_ids"), torch.Tensor)
            else {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}
        )


def cache_samples(cache) -> tuple:
    """(source, lengths, groups) of a `FeatureCache` (aux and last included): a shard is a group."""
    return cache, cache.lengths, cache_groups(cache)


def dataset_samples(dataset, packing: Packing, group_batches: int = 64) -> tuple:
    """(source, lengths, groups) of a prepared split, token ids only (features come from
    the target later): seeded groups of `group_batches` full micro-batches."""
    lengths = [len(x) for x in dataset["input_ids"]]
    group_size = max(1, group_batches * packing.max_batch_size)
    return dataset.with_format(None), lengths, dataset_groups(len(lengths), packing.seed, group_size)
