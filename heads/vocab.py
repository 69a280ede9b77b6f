"""The draft vocabulary map (DESIGN §2.2): the N most frequent masked target tokens.

`d2t` [Vd] int64: target id of draft row i is `i + d2t[i]` (the offset form vLLM reads);
`t2d` [Vt] bool: which target ids the draft vocabulary holds. Imports nothing from the
data/train/eval stages: it only needs a frequency vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VocabMap:
    """d2t [Vd] int64, t2d [Vt] bool, draft_ids [Vd] int64 (ascending target ids)."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.numel(), dtype=torch.int64) + self.d2t

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()


def build_vocab_map(freqs: torch.Tensor, draft_vocab_size: int) -> VocabMap | None:
    """The draft vocabulary from token frequencies over masked tokens.

    freqs [Vt] (counts; any numeric dtype). Picks the `draft_vocab_size` most frequent
    ids, ties broken by the lower id, so the map is deterministic. When fewer distinct
    tokens were seen than the draft vocabulary holds, the remaining rows are the unseen
    ids in ascending order (the same rule: frequency 0, lowest id first). Returns None
    when the draft vocabulary is the whole target vocabulary (no map is needed).
    """
    freqs = torch.as_tensor(freqs).flatten().to(torch.float64)
    vt = freqs.numel()
    if draft_vocab_size <= 0:
        raise ValueError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if draft_vocab_size >= vt:
        return None
    if (freqs < 0).any():
        raise ValueError("token frequencies must be non-negative")
    # Stable sort on -freq keeps ascending id order among equal counts.
    order = torch.sort(-freqs, stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values.to(torch.int64)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[used] = True
    return VocabMap(d2t=d2t, t2d=t2d)


def fit_frequencies(freqs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token counts [>=Vt or <Vt] -> [Vt]: ids past the target's vocabulary (tokenizer
    extras) cannot be drafted; missing ids count 0."""
    freqs = torch.as_tensor(freqs).flatten()
    if freqs.numel() >= vocab_size:
        return freqs[:vocab_size]
    return torch.cat([freqs, freqs.new_zeros(vocab_size - freqs.numel())])


def draft_vocab_coverage(head, freqs: torch.Tensor | None) -> float | None:
    """The share of the tokens counted in `freqs` [Vt counts] that a head's draft vocabulary
    (its `t2d`) holds; None without counts."""
    if freqs is None:
        return None
    counts = fit_frequencies(freqs, head.config.vocab_size).double()
    total = float(counts.sum())
    if total == 0:
        return None
    if not head.config.uses_vocab_map:
        return 1.0
    return float(counts[head.t2d.cpu()].sum()) / total
