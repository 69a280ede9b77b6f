"""Copy supervision for the EAGLE-3 head's attention.

A head trained on a few hundred thousand tokens does not learn to copy: on SmolLM2's
MT-bench replies its step-0 accuracy is ~33% where prompt lookup would be right and ~29%
elsewhere, so in repetitive replies the n-gram drafter beats it. Copying needs one
attention head to find the earlier slot j whose token x_j is the query's token x_{t+1};
slot j's input token x_{j+1} then names the next token. Through the loss alone that
content match forms only after a long plateau (none after 125 steps of a pure copy task
at lr 3e-3); supervising the attention scores directly forms it in ~100 steps.

`copy_attention_targets` finds, for every step-0 query slot, the slot it should read;
`copy_attention_loss` is the cross-entropy of one attention head's step-0 scores against
it. The head keeps its architecture (the serving format is unchanged): only the training
signal differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.heads.layers import apply_rope, rope_cos_sin
from eyas.train.ttt import shift_left

# Tokens of context that must agree (the query's token and the one before it) before an
# earlier slot counts as a copy source: a single shared token ("the", ",") has too many.
COPY_MIN_MATCH = 2


@torch.no_grad()
def copy_attention_targets(input_ids: torch.Tensor, label_valid: torch.Tensor, attention_mask: torch.Tensor,
                           min_match: int = COPY_MIN_MATCH) -> torch.Tensor:
    """The slot each step-0 query should read, or -1.

    input_ids, label_valid, attention_mask [B, T]; label_valid[b, s] says the target slot s
    carries a label (as `TargetLabels.valid`). Query slot t reads token x_{t+1} and learns
    the label of slot t+1 (token x_{t+2}). Its copy source is the latest slot j <= t with
    x_{j-m+1..j} == x_{t-m+2..t+1} (m = `min_match`) and x_{j+1} == x_{t+2}: the slot whose
    input token is the one to predict. Returns [B, T] long.
    """
    b, t = input_ids.shape
    out = torch.full((b, t), -1, dtype=torch.long, device=input_ids.device)
    if t < 3:
        return out
    x = input_ids.masked_fill(~attention_mask.bool(), -1)
    n = t - 2  # query slots with a token x_{t+2}
    q_idx = torch.arange(n, device=x.device)
    # match[b, q, j]: x_{j-i} == x_{q+1-i} for i < m, x_{j+1} == x_{q+2}, j <= q
    j_idx = torch.arange(t - 1, device=x.device)  # j + 1 must exist
    match = (x[:, None, 1:t] == x[:, 2:t, None])  # x_{j+1} == x_{q+2}: [B, n, t-1]
    for i in range(min_match):
        qi, ji = q_idx + 1 - i, j_idx - i
        xq = torch.where(qi >= 0, x[:, qi.clamp(min=0)], -3)  # before the start: matches nothing
        xj = torch.where(ji >= 0, x[:, ji.clamp(min=0)], -2)
        match &= xj[:, None, :] == xq[:, :, None]
    match &= j_idx[None, None, :] <= q_idx[None, :, None]
    match &= (x[:, 1:t] >= 0)[:, None, :]
    match &= label_valid[:, 1:n + 1].bool()[:, :, None]
    latest = (match.long() * (j_idx + 1)[None, None, :]).amax(-1) - 1  # [B, n]
    out[:, :n] = latest
    return out


def copy_attention_loss(head, batch: dict, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of attention head 0's step-0 scores (layer 0) against `targets`.

    batch: input_ids / attention_mask [B, T], aux [B, T, n·Ht]; targets [B, T] from
    `copy_attention_targets`. Recomputes only head 0's queries and keys (d columns of
    q_proj / k_proj), so the cost is one [B, T, T] score matrix. Returns a scalar (zero
    that still reaches the head's parameters when no slot has a target)."""
    layer = head.layers[0]
    attn = layer.self_attn
    d = attn.head_dim
    ids = batch["input_ids"]
    b, t = ids.shape
    tokens = shift_left(ids, 1, 0)  # slot t reads x_{t+1}, as TTT step 0 does
    hidden = head.combine_aux(batch["aux"])
    x = torch.cat([layer.input_layernorm(head.embed_tokens(tokens)), layer.hidden_norm(hidden)], dim=-1)
    q = F.linear(x, attn.q_proj.weight[:d])[:, None]  # [B, 1, T, d]
    k = F.linear(x, attn.k_proj.weight[:d])[:, None]
    positions = torch.arange(t, device=ids.device)[None].expand(b, t)
    cos, sin = rope_cos_sin(positions, d, attn.rope_theta, q.dtype)
    q, k = apply_rope(q, cos, sin)[:, 0], apply_rope(k, cos, sin)[:, 0]
    has = targets >= 0
    if not bool(has.any()):
        return (q.sum() + k.sum()) * 0.0
    rows_b, rows_t = has.nonzero(as_tuple=True)
    scores = (q @ k.transpose(1, 2)).float()[rows_b, rows_t] / d**0.5  # [N, T]
    keys = torch.arange(t, device=ids.device)
    scores = scores.masked_fill(keys[None, :] > rows_t[:, None], float("-inf"))
    return F.cross_entropy(scores, targets[rows_b, rows_t])
