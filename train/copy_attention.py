"""Copy supervision for the EAGLE-3 head's attention.

A head trained on a few hundred thousand tokens does not learn to copy: on SmolLM2's
MT-bench replies its step-0 accuracy is ~33% where prompt lookup would be right and ~29%
elsewhere, so in repetitive replies the n-gram drafter beats it. Copying needs one
attention head to find the earlier slot j whose token x_j is the query's token; slot j's
input token x_{j+1} then names the next token. Through the loss alone that content match
forms only after a long plateau (none after 125 steps of a pure copy task at lr 3e-3);
supervising the attention scores directly forms it in ~100 steps.

`copy_attention_targets` finds, for every query slot of the first TTT steps, the step-0
slot it should read; `recording_head0` collects attention head 0's queries and keys while
the TTT unroll runs (no second forward, and no parameter is read outside its module, so
sharded parameters are fine); `copy_attention_loss` is the cross-entropy of those scores
against the targets. The head keeps its architecture (the serving format is unchanged):
only the training signal differs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from eyas.core.segments import sample_spans

# Tokens of context that must agree (the query's token and the one before it) before an
# earlier slot counts as a copy source: a single shared token ("the", ",") has too many.
COPY_MIN_MATCH = 2


@torch.no_grad()
def copy_attention_targets(
    input_ids: torch.Tensor,
    label_valid: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int = 1,
    min_match: int = COPY_MIN_MATCH,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step-0 slot each query of TTT steps 0..steps-1 should read, or -1.

    input_ids, label_valid, attention_mask [B, T]; label_valid[b, s] says the target slot s
    carries a label (as `TargetLabels.valid`). At step k query slot t reads token
    x_{t+1+k} and learns the label of slot t+1+k (token x_{t+2+k}); it sees the step-0
    slots j <= t. Its copy source is the latest such j with
    x_{j-m+1..j} == x_{t+k-m+2..t+k+1} (m = `min_match`) and x_{j+1} == x_{t+k+2}: the
    slot whose input token is the one to predict. Returns [steps, B, T] long.

    `segments` [B, T] (a packed batch): each sample's targets are those it has alone, so no
    source, and no token of a match, lies in another sample; found sample by sample, which
    also keeps the work at each sample's T² rather than the row's.
    """
    if segments is not None:
        out = torch.full((steps, *input_ids.shape), -1, dtype=torch.long, device=input_ids.device)
        for r, a, e in sample_spans(attention_mask, segments):
            args = (input_ids[r : r + 1, a:e], label_valid[r : r + 1, a:e], attention_mask[r : r + 1, a:e])
            part = copy_attention_targets(*args, steps=steps, min_match=min_match)
            out[:, r : r + 1, a:e] = torch.where(part >= 0, part + a, -1)
        return out
    b, t = input_ids.shape
    out = torch.full((steps, b, t), -1, dtype=torch.long, device=input_ids.device)
    if t < 3:
        return out
    x = input_ids.masked_fill(~attention_mask.bool(), -1)
    n = t - 2  # step-0 query slots with a token x_{q+2}
    q_idx = torch.arange(n, device=x.device)
    # match[b, q, j]: x_{j-i} == x_{q+1-i} for i < m and x_{j+1} == x_{q+2}; the bound on j
    # depends on the step
    j_idx = torch.arange(t - 1, device=x.device)  # j + 1 must exist
    match = x[:, None, 1:t] == x[:, 2:t, None]  # [B, n, t-1]
    for i in range(min_match):
        qi, ji = q_idx + 1 - i, j_idx - i
        xq = torch.where(qi >= 0, x[:, qi.clamp(min=0)], -3)  # before the start: matches nothing
        xj = torch.where(ji >= 0, x[:, ji.clamp(min=0)], -2)
        match &= xj[:, None, :] == xq[:, :, None]
    match &= (x[:, 1:t] >= 0)[:, None, :]
    match &= label_valid[:, 1 : n + 1].bool()[:, :, None]
    for k in range(min(steps, n)):
        # step k's query slot t plays step 0's query q = t + k but sees only j <= t
        rows = match[:, k:] & (j_idx[None, None, :] <= q_idx[: n - k, None])
        out[k, :, : n - k] = (rows.long() * (j_idx + 1)).amax(-1) - 1
    return out


def targets_within_window(targets: torch.Tensor, window: int | None) -> torch.Tensor:
    """targets [steps, B, T] with the sources a sliding-window head cannot see set to -1:
    step k's query at slot t (position t + k) sees step-0 slots j > t + k - window only."""
    if window is None:
        return targets
    slots = torch.arange(targets.shape[-1], device=targets.device)
    step = torch.arange(targets.shape[0], device=targets.device)[:, None, None]
    return targets.masked_fill(slots + step - targets >= window, -1)


@contextlib.contextmanager
def recording_head0(head):
    """While active, every call of the head's first attention layer appends
    `(query, key)` of attention head 0, each `[B, T, d]` after RoPE, to the yielded list:
    one entry per TTT step, in order."""
    attn = head.layers[0].self_attn
    attn.head0_probe = []
    try:
        yield attn.head0_probe
    finally:
        attn.head0_probe = None


def copy_attention_loss(
    records: list, targets: torch.Tensor, decay: float = 1.0, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of attention head 0's scores against the copy sources.

    records: `(query, key)` per TTT step from `recording_head0`; targets [S, B, T] from
    `copy_attention_targets` (S <= len(records)). Step k's query at slot t is scored, as
    the TTT attention does, against the step-0 keys of slots <= t and the keys steps
    1..k wrote at slot t. Steps are weighted decay^k and averaged over the steps that
    have a target; with `segments` (a packed batch) each sample is scored over its own
    step-0 keys alone (its T², not the row's), the step's mean taken over the whole batch.
    Returns a scalar (a zero that still reaches the queries and keys when no slot has a
    target)."""
    keys0 = records[0][1]
    t = keys0.shape[1]
    spans = None if segments is None else sample_spans(torch.ones_like(segments), segments)
    total, weights = None, 0.0
    for k in range(targets.shape[0]):
        count = int((targets[k] >= 0).sum())
        if not count:
            continue
        if spans is None:
            loss_k = _step_cross_entropy(records, k, targets, slice(None), 0, t, "mean")
        else:
            parts = [
                _step_cross_entropy(records, k, targets, slice(r, r + 1), a, e, "sum")
                for r, a, e in spans
                if bool((targets[k, r, a:e] >= 0).any())
            ]
            loss_k = sum(parts) / count
        total = decay**k * loss_k if total is None else total + decay**k * loss_k
        weights += decay**k
    if total is None:
        return (records[0][0].sum() + keys0.sum()) * 0.0
    return total / weights


def _step_cross_entropy(records, k: int, targets, rows: slice, lo: int, hi: int, reduction: str):
    """Step k's cross-entropy over the queries with a target among rows `rows`, slots
    [lo, hi), scored against the step-0 keys of those slots (targets are row slots)."""
    keys0 = records[0][1][rows, lo:hi]
    q = records[k][0][rows, lo:hi]
    has = targets[k][rows, lo:hi] >= 0
    rows_b, rows_t = has.nonzero(as_tuple=True)
    d = keys0.shape[-1]
    key_pos = torch.arange(hi - lo, device=keys0.device)
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (the tests')
    step0 = (q @ keys0.transpose(1, 2))[rows_b, rows_t].to(acc)  # [N, hi - lo]
    step0 = step0.masked_fill(key_pos[None, :] > rows_t[:, None], float("-inf"))
    chain = [(q * records[i][1][rows, lo:hi]).sum(-1)[rows_b, rows_t, None].to(acc) for i in range(1, k + 1)]
    scores = torch.cat([step0] + chain, dim=1) / d**0.5
    return F.cross_entropy(scores, targets[k][rows, lo:hi][rows_b, rows_t] - lo, reduction=reduction)
