"""The EAGLE-3 hot path, restricted to the slots that carry loss.

Same math as `target_labels` + the reference `eyas.train.reference.ttt_loss` (the tests
compare them), with less work:
- labels: the target's full-vocabulary logits are computed only at slots whose next token
  is real and in the loss mask (assistant tokens), not at every slot, with the LM head's
  draft rows first so the draft logits are a slice and the rest needs only a max;
- loss: at TTT step k the head's LM head, log-softmax, cross-entropy and argmax run only
  on the query slots whose label slot (t + 1 + k) is valid, the label probabilities are
  computed once for all steps, and the cross-entropy has a hand-written backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eyas.core.sampling import argmax_rows
from eyas.core.segments import next_in_segment, segment_positions
from eyas.heads.layers import TTTMask
from eyas.train.batching import round_up, shift_left
from eyas.train.losses import LossKind, TargetLabels, loss_rows, loss_terms_rows
from eyas.train.step_stats import StepStats


@dataclass
class DraftFirstLMHead:
    """The target's LM head `[Vt, Ht]` with its rows reordered: the draft vocabulary first,
    in draft order, then every other row. One GEMM then gives the draft logits as a
    contiguous slice `[:, :Vd]` and the best non-draft logit from the rest."""

    weight: torch.Tensor
    draft_size: int


def draft_first_lm_head(lm_head_weight: torch.Tensor, draft_ids: torch.Tensor) -> DraftFirstLMHead:
    """lm_head_weight [Vt, Ht]; draft_ids [Vd] target ids of the draft rows. Copies the
    weight once when Vd < Vt (a model-sized LM head, e.g. 1.2 GB for GPT-OSS in bf16)."""
    vt, vd = lm_head_weight.shape[0], draft_ids.numel()
    if vd == vt:
        return DraftFirstLMHead(lm_head_weight, vt)
    draft_ids = draft_ids.to(lm_head_weight.device)
    rest = torch.ones(vt, dtype=torch.bool, device=lm_head_weight.device)
    rest[draft_ids] = False
    order = torch.cat([draft_ids, rest.nonzero().squeeze(1)])
    return DraftFirstLMHead(lm_head_weight.index_select(0, order), vd)


def label_mask(batch: dict, label_prompts: bool) -> torch.Tensor:
    """The slots whose next token a label is computed for (DESIGN §2.4): the loss mask, or
    with `train.label_prompts` every real token of the sample."""
    return batch["attention_mask"] if label_prompts else batch["loss_mask"]


@torch.no_grad()
def valid_row_labels(
    last_hidden: torch.Tensor,
    norm: nn.Module,
    lm_head: DraftFirstLMHead,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int = 4096,
    known_valid: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> TargetLabels:
    """`target_labels` computed only where token s+1 is real and masked; other slots get
    zero logits, argmax -1 and valid False. Shapes as in `target_labels`; `lm_head` from
    `draft_first_lm_head`. A slot counts when the target's top logit is reached by a draft
    token (on an exact tie with a token outside the draft vocabulary it counts).

    `known_valid` [B, T] bool: the `valid` an earlier call returned for the same samples
    (a later epoch). Only the draft rows of the LM head are then multiplied: the rest of
    the vocabulary (5/6 of SmolLM2's, 24/25 of GPT-OSS's at a 8k draft) served only to
    decide validity.

    `segments` [B, T] (packed rows): a slot whose next token starts another sample has no
    label."""
    b, t, ht = last_hidden.shape
    nxt_ok = torch.zeros(b, t, dtype=torch.bool, device=last_hidden.device)
    nxt_ok[:, :-1] = loss_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    if segments is not None:
        nxt_ok &= next_in_segment(segments)
    rows = nxt_ok.reshape(-1).nonzero().squeeze(1)
    flat = last_hidden.reshape(-1, ht)
    vd, weight = lm_head.draft_size, lm_head.weight
    logits = torch.zeros(b * t, vd, dtype=torch.float32, device=last_hidden.device)
    argmax = torch.full((b * t,), -1, dtype=torch.long, device=last_hidden.device)
    valid = torch.zeros(b * t, dtype=torch.bool, device=last_hidden.device)
    for start in range(0, rows.numel(), chunk_tokens):
        r = rows[start : start + chunk_tokens]
        # computed on a row count rounded up (repeating a row), the rest dropped: one shape
        # per few batches instead of one per batch
        padded = torch.cat([r, r[:1].expand(_round_up(r.numel()) - r.numel())])
        read = weight[:vd] if known_valid is not None else weight  # draft rows first
        full = (norm(flat[padded].to(weight.dtype)) @ read.T)[: r.numel()]  # [n, Vt or Vd]
        draft = full[:, :vd].float()
        best = argmax_rows(draft)
        logits[r] = draft
        if known_valid is not None:
            inside = known_valid.reshape(-1)[r].bool()
        elif vd < full.shape[1]:
            # amax without indices is several times cheaper than argmax over Vt on CPU
            inside = draft.gather(1, best[:, None])[:, 0] >= full[:, vd:].amax(-1).float()
        else:
            inside = torch.ones_like(best, dtype=torch.bool)
        argmax[r] = torch.where(inside, best, -1)
        valid[r] = inside
    return TargetLabels(logits=logits.view(b, t, vd), argmax=argmax.view(b, t), valid=valid.view(b, t))


ROW_MULTIPLE = 64


def _round_up(n: int) -> int:
    """n rounded up to a multiple of ROW_MULTIPLE: matmul row counts drawn from few values,
    because CPU kernels (oneDNN) and torch.compile build code per shape and rebuilding it
    for every batch costs more than the padded rows."""
    return round_up(n, ROW_MULTIPLE)


def padded_rows(x: torch.Tensor, fill=None) -> torch.Tensor:
    """x [N, ...] with rows appended up to a multiple of ROW_MULTIPLE (`_round_up`): `fill`,
    or copies of row 0. The caller keeps N to tell the real rows from the added ones."""
    pad = _round_up(x.shape[0]) - x.shape[0]
    extra = x[:1].expand(pad, *x.shape[1:]) if fill is None else x.new_full((pad, *x.shape[1:]), fill)
    return torch.cat([x, extra])


# Rows from which a step's LM head and loss run in chunks recomputed in the backward: kept,
# a step's [rows, Vd] logits and their gradient grow with the sample (2 GB at 32k tokens
# and an 8k draft vocabulary), per TTT step.
LOSS_CHUNK_ROWS = 8192


def _rows_loss(lm_head, rows: torch.Tensor, probs: torch.Tensor, loss: LossKind, compile_mode: str):
    return loss_terms_rows(lm_head(rows), probs, loss, compile_mode)


def _lm_head_loss(lm_head, rows: torch.Tensor, probs: torch.Tensor, loss: LossKind, compile_mode: str):
    """(cross-entropy [N], total variation [N] or None, argmax [N]) of the LM head over
    `rows` [N, H] against `probs` (`loss_terms_rows`); past `LOSS_CHUNK_ROWS` rows in
    checkpointed chunks, so memory stays at one chunk's. The LK blend weight needs every
    row's acceptance, so the terms come back per row and are blended by the caller."""
    if rows.shape[0] <= LOSS_CHUNK_ROWS or not torch.is_grad_enabled():
        return _rows_loss(lm_head, rows, probs, loss, compile_mode)
    from torch.utils.checkpoint import checkpoint

    parts = [
        checkpoint(
            _rows_loss,
            lm_head,
            rows[i : i + LOSS_CHUNK_ROWS],
            probs[i : i + LOSS_CHUNK_ROWS],
            loss,
            compile_mode,
            use_reentrant=False,
        )
        for i in range(0, rows.shape[0], LOSS_CHUNK_ROWS)
    ]
    tv = None if parts[0][1] is None else torch.cat([part[1] for part in parts])
    return torch.cat([part[0] for part in parts]), tv, torch.cat([part[2] for part in parts])


def ttt_loss_valid_rows(
    head,
    batch: dict,
    labels: TargetLabels,
    steps: int,
    decay: float,
    compile_mode: str = "off",
    loss: LossKind = "kl",
    lk_eta: float = 3.0,
) -> StepStats:
    """The TTT loss (`eyas.train.reference.ttt_loss`) with the LM head and the loss evaluated
    only on valid query slots; the head's layers run as in `forward_step`. `loss` /
    `lk_eta`: the recipe's `train.loss` / `train.lk_eta` (an LK weight per TTT step).

    Every step reads the rows of the valid label slots s in one fixed order: step k's
    query for label s is slot s-1-k of the same sample (absent, weight 0, when s-1-k
    falls before the sample's start), so the target probabilities are gathered once,
    not once per step. A packed batch (`segments`, DESIGN §3) runs each sample as alone:
    positions restart at its start and its queries see no other sample's keys."""
    input_ids, am = batch["input_ids"], batch["attention_mask"]
    b, t = input_ids.shape
    segments = batch.get("segments")
    mask = TTTMask(am, window=head.config.sliding_window, segments=segments)
    cache = head.new_cache()
    if segments is None:
        positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    else:
        positions = segment_positions(segments)
    hid = head.combine_aux(batch["aux"])
    label_rows = labels.valid.reshape(-1).nonzero().squeeze(1)  # flat slots s, ascending
    # The row count is rounded up with copies of slot 0 that never count (`real`), so the
    # LM head and loss see a few shapes, not one per batch.
    n_rows = label_rows.numel()
    label_rows = padded_rows(label_rows, fill=0)
    real = torch.arange(label_rows.numel(), device=label_rows.device) < n_rows
    label_pos = positions.reshape(-1).index_select(0, label_rows)  # s's position inside its sample
    probs = torch.softmax(labels.logits.reshape(b * t, -1).index_select(0, label_rows).float(), dim=-1)
    label_argmax = labels.argmax.reshape(-1).index_select(0, label_rows)
    stats = StepStats(loss=torch.zeros(()), tokens=int(am.sum()))
    total = None
    for k in range(steps):
        h = head.forward_layers(shift_left(input_ids, 1 + k, 0), hid, positions + k, cache, mask)
        normed = head.norm(h)
        present = (label_pos >= 1 + k) & real
        count = int(present.sum())
        if count:
            # an absent one reads some other slot (an earlier sample's, or slot 0): weight 0
            queries = (label_rows - (1 + k)).clamp(min=0)
            ce, tv, top = _lm_head_loss(
                head.lm_head, normed.reshape(b * t, -1).index_select(0, queries), probs, loss, compile_mode
            )
            rows = loss_rows(loss, ce, tv, torch.where(present, 0, -1), lk_eta)
            loss_k = (rows * present).sum() / count
            hits = int(((top == label_argmax) & present).sum())
        else:
            # a zero that still reaches every parameter (the LM head included), so DDP sees
            # each one used and every rank runs the same backward
            loss_k = head.lm_head(normed.reshape(b * t, -1)[:1]).float().sum() * 0.0
            hits = 0
        total = decay**k * loss_k if total is None else total + decay**k * loss_k
        stats.step_losses.append(float(loss_k.detach()))
        stats.hits.append(hits)
        stats.counts.append(count)
        hid = normed if head.config.norm_output else h
    stats.loss = total
    return stats
