"""Picking the next token from logits, shared by regeneration, the draft heads and eval."""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float = 1.0, generator=None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: the argmax at temperature 0, else a sample of
    softmax(logits / temperature), restricted to the nucleus of mass `top_p` when < 1."""
    if temperature <= 0:
        # bf16 -> float32 is exact, and float32 argmax is ~4x faster than bf16's on CPU
        return logits.float().argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
