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
from torch.utils.checkpoint import checkpoint

from eyas.core.segments import sample_spans

# Tokens of context that must agree (the query's token and the one before it) before an
# earlier slot counts as a copy source: a single shared token ("the", ",") has too many.
COPY_MIN_MATCH = 2
# Query slots per block of the copy targets and of the copy loss: bounds the [queries, keys]
# tensors at a few MB per thousand keys, whatever the sample's length.
COPY_QUERY_BLOCK = 512


@torch.no_grad()
def copy_attention_targets(
    input_ids: torch.Tensor,
    label_valid: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int = 1,
    min_match: int = COPY_MIN_MATCH,
    segments: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The step-0 slot each query of TTT steps 0..steps-1 should read, or -1.

    input_ids, label_valid, attention_mask [B, T]; label_valid[b, s] says the target slot s
    carries a label (as `TargetLabels.valid`). At step k query slot t reads token
    x_{t+1+k} and learns the label of slot t+1+k (token x_{t+2+k}); it sees the step-0
    slots j <= t. Its copy source is the latest such j with
    x_{j-m+1..j} == x_{t+k-m+2..t+k+1} (m = `min_match`) and x_{j+1} == x_{t+k+2}: the
    slot whose input token is the one to predict. Returns [steps, B, T] long.

    `window` (head.sliding_window): step k's query at slot t (position t + k) sees the
    step-0 slots j > t + k - window only, so a source farther back is no target.
    `segments` [B, T] (a packed batch): each sample's targets are those it has alone, so no
    source, and no token of a match, lies in another sample; found sample by sample.
    Queries go in blocks of `COPY_QUERY_BLOCK`, each compared with the slots it can see:
    memory stays linear in T, and so does the work under a window.
    """
    if segments is not None:
        out = torch.full((steps, *input_ids.shape), -1, dtype=torch.long, device=input_ids.device)
        for r, a, e in sample_spans(attention_mask, segments):
            args = (input_ids[r : r + 1, a:e], label_valid[r : r + 1, a:e], attention_mask[r : r + 1, a:e])
            part = copy_attention_targets(*args, steps=steps, min_match=min_match, window=window)
            out[:, r : r + 1, a:e] = torch.where(part >= 0, part + a, -1)
        return out
    b, t = input_ids.shape
    out = torch.full((steps, b, t), -1, dtype=torch.long, device=input_ids.device)
    if t < 3:
        return out
    x = input_ids.masked_fill(~attention_mask.bool(), -1)
    n = t - 2  # step-0 query slots q with a token x_{q+2}
    for q0 in range(0, n, COPY_QUERY_BLOCK):
        q = torch.arange(q0, min(n, q0 + COPY_QUERY_BLOCK), device=x.device)
        # every step's query playing step-0 query q sees j <= q, and j > q - window
        j = torch.arange(0 if window is None else max(0, q0 - window + 1), int(q[-1]) + 1, device=x.device)
        match = x[:, j + 1][:, None, :] == x[:, q + 2][:, :, None]  # [B, q, j]
        for i in range(min_match):
            # a token before the start matches nothing
            xq = torch.where(q + 1 - i >= 0, x[:, (q + 1 - i).clamp(min=0)], -3)
            xj = torch.where(j - i >= 0, x[:, (j - i).clamp(min=0)], -2)
            match &= xj[:, None, :] == xq[:, :, None]
        match &= (x[:, j + 1] >= 0)[:, None, :]
        match &= label_valid[:, q + 1].bool()[:, :, None]
        if window is not None:
            match &= j[None, :] > q[:, None] - window
        for k in range(min(steps, n)):
            # step k's query slot q - k plays step-0 query q but sees only j <= q - k
            rows = (match & (j[None, :] <= q[:, None] - k)).long() * (j + 1)
            found = rows.amax(-1) - 1  # [B, q]
            has_slot = q >= k
            out[k, :, q[has_slot] - k] = found[:, has_slot]
    return out


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
    records: list,
    targets: torch.Tensor,
    decay: float = 1.0,
    segments: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of attention head 0's scores against the copy sources.

    records: `(query, key)` per TTT step from `recording_head0`; targets [S, B, T] from
    `copy_attention_targets` (S <= len(records)). Step k's query at slot t is scored, as
    the TTT attention does, against the step-0 keys of slots <= t (and > t + k - `window`)
    and the keys steps 1..k wrote at slot t. Steps are weighted decay^k and averaged over
    the steps that have a target; with `segments` (a packed batch) each sample is scored
    over its own step-0 keys alone, the step's mean taken over the whole batch.
    Returns a scalar (a zero that still reaches the queries and keys when no slot has a
    target)."""
    keys0 = records[0][1]
    spans = sample_spans(torch.ones(keys0.shape[:2], device=keys0.device), segments)
    total, weights = None, 0.0
    for k in range(targets.shape[0]):
        count = int((targets[k] >= 0).sum())
        if not count:
            continue
        loss_k = sum(
            _step_cross_entropy(records, k, targets, r, a, e, window)
            for r, a, e in spans
            if bool((targets[k, r, a:e] >= 0).any())
        )
        total = decay**k * loss_k / count if total is None else total + decay**k * loss_k / count
        weights += decay**k
    if total is None:
        return (records[0][0].sum() + keys0.sum()) * 0.0
    return total / weights


def _step_cross_entropy(records, k: int, targets, row: int, lo: int, hi: int, window: int | None):
    """The summed cross-entropy of step k's queries with a target in row `row`, slots
    [lo, hi) (one sample), scored against that sample's keys (targets are row slots).
    Block by block of queries, each against the keys it can see, and recomputed for the
    backward pass rather than kept: no [queries, keys] tensor of the whole sample lives."""
    slots = (targets[k, row, lo:hi] >= 0).nonzero(as_tuple=True)[0]
    total = None
    for b0 in range(0, len(slots), COPY_QUERY_BLOCK):
        t = slots[b0 : b0 + COPY_QUERY_BLOCK]
        first, last = int(t[0]), int(t[-1])
        k0 = 0 if window is None else max(0, first + k - window + 1)
        q = records[k][0][row, lo:hi][t]  # [N, d]
        keys0 = records[0][1][row, lo + k0 : lo + last + 1]  # the step-0 keys any query of the block sees
        chain = [records[i][1][row, lo:hi][t] for i in range(1, k + 1)]  # [N, d] each
        source = targets[k, row, lo:hi][t] - lo - k0
        args = (q, keys0, t - k0, source, k, window, *chain)
        part = checkpoint(_block_cross_entropy, *args, use_reentrant=False)
        total = part if total is None else total + part
    return total


def _block_cross_entropy(q, keys0, t, source, k: int, window: int | None, *chain):
    """Summed cross-entropy of queries q [N, d] at slots t [N] (relative to keys0's first
    slot) over the step-0 keys they see and their own chain keys, against `source`."""
    d = q.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (the tests')
    key_pos = torch.arange(keys0.shape[0], device=q.device)
    step0 = (q @ keys0.T).to(acc)  # [N, keys]
    hidden = key_pos[None, :] > t[:, None]
    if window is not None:  # position t + k sees key positions > t + k - window
        hidden |= key_pos[None, :] <= t[:, None] + k - window
    step0 = step0.masked_fill(hidden, float("-inf"))
    own = [(q * c).sum(-1, keepdim=True).to(acc) for c in chain]
    scores = torch.cat([step0, *own], dim=1) / d**0.5
    return F.cross_entropy(scores, source, reduction="sum")
