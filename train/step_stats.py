"""What one training forward over a batch reports: every algorithm's loss function returns a
`StepStats` (DESIGN §2.4), whichever unroll (TTT steps, P-EAGLE depths) produced it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepStats:
    """Loss and accuracy counts of one forward over a batch (per unrolled step/depth)."""

    loss: torch.Tensor
    step_losses: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    tokens: int = 0  # real tokens processed
    extra_losses: dict[str, float] = field(default_factory=dict)  # named terms inside `loss`, for logging
