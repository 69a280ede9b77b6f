"""Attention masks for training (DESIGN §3, §4), each with a brute-force reference the
tests compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask [B, T] (1 = real token, right padding) -> [B, 1, T, T] bool: query t
    sees real keys s <= t. A padded query sees nothing."""
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    real = attention_mask.bool()
    return causal[None, None] & real[:, None, None, :] & real[:, None, :, None]


def ttt_reference_mask(t: int, k: int, window: int | None = None) -> torch.Tensor:
    """The TTT rule for step k over the flattened key axis of length (k+1)·T, written
    entry by entry: allow(q, j) = (j < T and j <= q) or (j >= T and j ≡ q mod T); with a
    sliding window also: the query's position q + k minus the key's position (j for a
    step-0 key, q + j // T for a diagonal one) is below the window."""
    mask = torch.zeros(t, (k + 1) * t, dtype=torch.bool)
    for q in range(t):
        for j in range((k + 1) * t):
            mask[q, j] = (j < t and j <= q) or (j >= t and j % t == q)
            key_position = j if j < t else q + j // t
            if window is not None and q + k - key_position >= window:
                mask[q, j] = False
    return mask


def ttt_dense_mask(attention_mask: torch.Tensor, k: int, window: int | None = None) -> torch.Tensor:
    """[B, 1, T, (k+1)·T]: the TTT rule for step k with padding, as one dense mask over
    the step-0 keys followed by the keys of steps 1..k (for SDPA over concatenated keys)."""
    base = causal_padding_mask(attention_mask)
    t = attention_mask.shape[1]
    if window is not None:
        slots = torch.arange(t, device=attention_mask.device)
        base = base & (slots[:, None] + k - slots[None, :] < window)[None, None]
    diag = (
        torch.eye(t, dtype=torch.bool, device=attention_mask.device)[None, None]
        & attention_mask.bool()[:, None, :, None]
    )
    diagonals = [diag if window is None or k - j < window else diag & False for j in range(1, k + 1)]
    return torch.cat([base, *diagonals], dim=-1)


# --- P-EAGLE (DESIGN §4) ------------------------------------------------------------
# Elements are (anchor p, depth d) pairs flattened along one axis; `real` marks elements
# that exist (not padding). One rule, `peagle_allow`, is behind the dense mask (SDPA) and
# the flex-attention block mask (CUDA); `peagle_reference_mask` restates it entry by entry.


def peagle_allow(
    anchor_q,
    depth_q,
    real_q,
    anchor_k,
    depth_k,
    real_k,
    same,
    window: int | None = None,
    start_q=None,
    start_k=None,
):
    """The P-EAGLE attention rule on broadcastable tensors (True = q may attend to kv):
    both real and ((depth_k = 0 and anchor_k <= anchor_q) or (anchor_k = anchor_q and
    depth_k <= depth_q)); with a sliding window also (anchor_q + depth_q) - (anchor_k +
    depth_k) < window, positions being anchor + depth. A padding query sees only itself
    (`same`: q and kv are the same element) so that no softmax row is empty; such rows
    never carry loss. `start_q` / `start_k` (a packed batch): the first slot of each
    anchor's sample; a depth-0 key then counts only for a query of the same sample."""
    prefix = (depth_k == 0) & (anchor_k <= anchor_q)
    if start_q is not None:
        prefix = prefix & (start_k == start_q)
    rule = prefix | ((anchor_k == anchor_q) & (depth_k <= depth_q))
    if window is not None:
        rule = rule & ((anchor_q + depth_q) - (anchor_k + depth_k) < window)
    return (real_q & real_k & rule) | (~real_q & same)


def peagle_reference_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    real: torch.Tensor,
    window: int | None = None,
    sample: torch.Tensor | None = None,
) -> torch.Tensor:
    """anchor / depth / real [L] of one row -> [L, L] bool, written entry by entry;
    `sample` [L]: the sample each element's anchor belongs to (a packed row)."""
    n = anchor.shape[0]
    a, d, r = anchor.tolist(), depth.tolist(), real.bool().tolist()
    s = sample.tolist() if sample is not None else [0] * n
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            if not r[q]:
                mask[q, k] = q == k
            elif r[k]:
                mask[q, k] = (d[k] == 0 and a[k] <= a[q] and s[k] == s[q]) or (a[k] == a[q] and d[k] <= d[q])
                if window is not None and (a[q] + d[q]) - (a[k] + d[k]) >= window:
                    mask[q, k] = False
    return mask


def peagle_dense_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    real: torch.Tensor,
    window: int | None = None,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """anchor / depth / real [B, L] -> [B, 1, L, L] bool for SDPA; `start` [B, L] the first
    slot of each element's sample (a packed batch; None: one sample per row)."""
    n = anchor.shape[1]
    same = torch.eye(n, dtype=torch.bool, device=anchor.device)[None]
    real = real.bool()
    allow = peagle_allow(
        anchor[:, :, None],
        depth[:, :, None],
        real[:, :, None],
        anchor[:, None, :],
        depth[:, None, :],
        real[:, None, :],
        same,
        window,
        None if start is None else start[:, :, None],
        None if start is None else start[:, None, :],
    )
    return allow[:, None]


def peagle_mask_mod(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    real: torch.Tensor,
    window: int | None = None,
    start: torch.Tensor | None = None,
):
    """A flex-attention mask_mod (b, h, q_idx, kv_idx) -> bool for elements [B, L]."""
    real = real.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        return peagle_allow(
            anchor[b, q_idx],
            depth[b, q_idx],
            real[b, q_idx],
            anchor[b, kv_idx],
            depth[b, kv_idx],
            real[b, kv_idx],
            q_idx == kv_idx,
            window,
            None if start is None else start[b, q_idx],
            None if start is None else start[b, kv_idx],
        )

    return mask_mod


def peagle_block_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    real: torch.Tensor,
    window: int | None = None,
    start: torch.Tensor | None = None,
):
    """anchor / depth / real (/ start) [B, L] -> a flex-attention BlockMask (built once per
    batch or segment; masked blocks are skipped on CUDA) over B and L rounded up to
    `flex_bucket`s, the added rows and elements padding (flex_block_attention pads q, k
    and v to match)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eyas.heads.flex_attention import FLEX_MIN_LENGTH, flex_bucket

    b, n = anchor.shape
    rows, length = flex_bucket(b), flex_bucket(n, FLEX_MIN_LENGTH)
    pad = (0, length - n, 0, rows - b)
    anchor, depth, real = (F.pad(x.long(), pad) for x in (anchor, depth, real))
    start = None if start is None else F.pad(start.long(), pad)
    mask_mod = peagle_mask_mod(anchor, depth, real, window, start)
    return create_block_mask(mask_mod, rows, None, length, length, device=anchor.device)
