"""Reference implementations that only tests run: the plain EAGLE-3 training-time test
(DESIGN §3) over every slot, against which the valid-row loss that training uses
(`eyas.train.fastpath.ttt_loss_valid_rows`) and the drafting paths are checked.

Unroll the head S steps over every slot of a batch, feeding each step its own previous
hidden state, teacher-forced tokens and positions moved by one per step; the loss is the
decayed sum of per-step losses (`train.loss`: soft-label cross-entropy, total variation
or their LK blend, each written here densely, with autograd's gradients).
"""

from __future__ import annotations

import torch

from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.layers import TTTMask
from eyas.train.batching import shift_left
from eyas.train.losses import TargetLabels, argmax_accuracy, soft_cross_entropy
from eyas.train.step_stats import StepStats


def ttt_unroll(head: Eagle3Head, input_ids, attention_mask, aux, steps: int):
    """Yield (k, logits [B, T, Vd]) for TTT steps k = 0..steps-1.

    input_ids / attention_mask [B, T] (right padded); aux [B, T, n·Ht]. Step k at slot t
    sees token x_{t+1+k} at position t+k and, as hidden input, its own output of step k-1
    at slot t (step 0: fc of the target's features at t).
    """
    b, t = input_ids.shape
    mask = TTTMask(attention_mask, window=head.config.sliding_window)
    cache = head.new_cache()
    positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    hid = head.combine_aux(aux)
    for k in range(steps):
        tokens = shift_left(input_ids, 1 + k, 0)
        logits, hid = head.forward_step(tokens, hid, positions + k, cache, mask)
        yield k, logits


def dense_loss(draft_logits, target_logits, valid, loss: str = "kl", lk_eta: float = 3.0) -> torch.Tensor:
    """Masked mean over valid slots of `train.loss` from its definition: kl is the
    soft-label cross-entropy, tv = ½ Σ_v |p(v) - q(v)|, lk = λ·kl + (1 - λ)·tv with
    λ = exp(-lk_eta · mean over the slots of Σ_v min(p, q)), λ held constant."""
    if loss == "kl":
        return soft_cross_entropy(draft_logits, target_logits, valid)
    sel = valid.reshape(-1)
    if not bool(sel.any()):
        return draft_logits.sum() * 0.0
    z = draft_logits.reshape(-1, draft_logits.shape[-1])[sel]
    q = torch.softmax(z, dim=-1)
    p = torch.softmax(target_logits.reshape(-1, target_logits.shape[-1])[sel].to(q.dtype), dim=-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    if loss == "tv":
        return tv.mean()
    ce = -(p * torch.log_softmax(z, dim=-1)).sum(-1)
    lam = torch.exp(-lk_eta * torch.minimum(p, q).sum(-1).mean()).detach()
    return (lam * ce + (1 - lam) * tv).mean()


def ttt_loss(
    head: Eagle3Head,
    batch: dict,
    labels: TargetLabels,
    steps: int,
    decay: float,
    loss: str = "kl",
    lk_eta: float = 3.0,
) -> StepStats:
    """Σ_k decay^k · L_k, each L_k a masked mean of `dense_loss` (DESIGN §3). `batch` holds
    input_ids, attention_mask and aux; `labels` come from `target_labels` on the same batch."""
    total = None
    stats = StepStats(loss=torch.zeros(()), tokens=int(batch["attention_mask"].sum()))
    for k, logits in ttt_unroll(head, batch["input_ids"], batch["attention_mask"], batch["aux"], steps):
        lab = labels.shifted(1 + k)
        loss_k = dense_loss(logits, lab.logits, lab.valid, loss, lk_eta)
        total = decay**k * loss_k if total is None else total + decay**k * loss_k
        hits, count = argmax_accuracy(logits.detach(), lab.argmax, lab.valid)
        stats.step_losses.append(float(loss_k.detach()))
        stats.hits.append(hits)
        stats.counts.append(count)
    stats.loss = total
    return stats
