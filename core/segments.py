"""Packed rows (`train.packing`, DESIGN §3): several samples concatenated into one batch
row, told apart by `segments` [B, T] long, the index of each slot's sample inside its row
(0, 1, ...; -1 for padding). Everything the head and the losses need is derived here from
that one tensor: where a slot's sample starts, its position inside the sample (the head's
RoPE restarts at 0 for every sample) and whether the next slot belongs to the same one."""

from __future__ import annotations

import torch


def segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] long: the slot where each slot's segment (a sample, or the padding run)
    begins. Two slots of a row share a sample exactly when their starts are equal."""
    t = segments.shape[1]
    slots = torch.arange(t, device=segments.device).expand_as(segments)
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.where(first, slots, 0).cummax(dim=1).values


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] long: each slot's position inside its sample (0 at every sample's start)."""
    slots = torch.arange(segments.shape[1], device=segments.device)[None]
    return slots - segment_starts(segments)


def next_in_segment(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: slot s + 1 holds the next token of slot s's sample (False at a sample's
    last slot and at the row's end), so a label at s may read token s + 1."""
    out = torch.zeros_like(segments, dtype=torch.bool)
    out[:, :-1] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] >= 0)
    return out


def sample_spans(attention_mask: torch.Tensor, segments: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sample of a batch, row by row and left to right: the
    order of the batch's `index`. Without `segments` a row is one right-padded sample."""
    if segments is None:
        return [(r, 0, int(n)) for r, n in enumerate(attention_mask.sum(1).tolist())]
    spans = []
    for r, row in enumerate(segments.tolist()):
        start = 0
        for s in range(1, len(row) + 1):
            if s == len(row) or row[s] != row[start]:
                if row[start] >= 0:
                    spans.append((r, start, s))
                start = s
    return spans
