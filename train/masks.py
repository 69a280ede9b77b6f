"""Attention masks for training (DESIGN §3, §4), each with a brute-force reference the
tests compare against."""

from __future__ import annotations

import torch


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask [B, T] (1 = real token, right padding) -> [B, 1, T, T] bool: query t
    sees real keys s <= t. A padded query sees nothing."""
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    real = attention_mask.bool()
    return causal[None, None] & real[:, None, None, :] & real[:, None, :, None]


def ttt_reference_mask(t: int, k: int) -> torch.Tensor:
    """The TTT rule for step k over the flattened key axis of length (k+1)·T, written
    entry by entry: allow(q, j) = (j < T and j <= q) or (j >= T and j ≡ q mod T)."""
    mask = torch.zeros(t, (k + 1) * t, dtype=torch.bool)
    for q in range(t):
        for j in range((k + 1) * t):
            mask[q, j] = (j < t and j <= q) or (j >= t and j % t == q)
    return mask


def ttt_dense_mask(attention_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[B, 1, T, (k+1)·T]: the TTT rule for step k with padding, as one dense mask over
    the step-0 keys followed by the keys of steps 1..k (for SDPA over concatenated keys)."""
    base = causal_padding_mask(attention_mask)
    t = attention_mask.shape[1]
    diag = torch.eye(t, dtype=torch.bool, device=attention_mask.device)[None, None] & attention_mask.bool()[:, None, :, None]
    return torch.cat([base] + [diag] * k, dim=-1)
