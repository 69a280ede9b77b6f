"""Targets and losses: the frozen target's distribution restricted to the draft
vocabulary, and the per-row losses against it (DESIGN §2.4, `train.loss`): the soft-label
cross-entropy ("kl": forward KL up to the target's entropy, a constant), the total
variation ("tv": 1 - the expected acceptance of speculative sampling) and their LK blend
("lk")."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from eyas.core.sampling import argmax_rows
from eyas.core.segments import next_in_segment

log = logging.getLogger(__name__)

LossKind = Literal["kl", "tv", "lk"]


@dataclass
class TargetLabels:
    """What the head learns at each target slot s (the target's distribution of token s+1).

    logits: [B, T, Vd] target logits on the draft vocabulary (float32)
    argmax: [B, T] draft index of the target's argmax, -1 where it lies outside the draft
        vocabulary
    valid:  [B, T] bool: slot s counts (token s+1 is real and inside the loss mask, and the
        target's argmax is in the draft vocabulary)
    """

    logits: torch.Tensor
    argmax: torch.Tensor
    valid: torch.Tensor

    def shifted(self, offset: int) -> TargetLabels:
        """Labels for query slot t taken from target slot t + offset (invalid past the end)."""
        if offset == 0:
            return self
        b, t = self.valid.shape
        pad_valid = torch.zeros(b, offset, dtype=torch.bool, device=self.valid.device)
        pad_arg = torch.full((b, offset), -1, dtype=self.argmax.dtype, device=self.argmax.device)
        pad_logits = self.logits.new_zeros(b, offset, self.logits.shape[-1])
        return TargetLabels(
            logits=torch.cat([self.logits[:, offset:], pad_logits], dim=1),
            argmax=torch.cat([self.argmax[:, offset:], pad_arg], dim=1),
            valid=torch.cat([self.valid[:, offset:], pad_valid], dim=1),
        )


@torch.no_grad()
def target_labels(
    last_hidden: torch.Tensor,
    norm: nn.Module,
    lm_head_weight: torch.Tensor,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor | None,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int = 4096,
    segments: torch.Tensor | None = None,
) -> TargetLabels:
    """Recompute the target's logits from its pre-norm last hidden state.

    last_hidden [B, T, Ht]; lm_head_weight [Vt, Ht]; draft_ids [Vd] target ids of the draft
    rows; t2d [Vt] bool or None (no map); loss_mask / attention_mask [B, T]; segments
    [B, T] of a packed batch (no label where the next token starts another sample).
    Chunked over tokens so a 200k vocabulary never materialises [B·T, Vt] at once.
    """
    b, t, ht = last_hidden.shape
    flat = last_hidden.reshape(-1, ht)
    draft_logits, argmax = [], []
    weight = lm_head_weight
    for start in range(0, flat.shape[0], chunk_tokens):
        x = norm(flat[start : start + chunk_tokens].to(weight.dtype))
        full = x @ weight.T  # [n, Vt]
        argmax.append(full.argmax(-1))
        draft_logits.append(full[:, draft_ids].float())
    full_argmax = torch.cat(argmax).view(b, t)
    logits = torch.cat(draft_logits).view(b, t, -1)
    if t2d is None:
        in_draft = torch.ones_like(full_argmax, dtype=torch.bool)
        draft_index = full_argmax
    else:
        in_draft = t2d[full_argmax]
        # position of each target id inside the sorted draft vocabulary
        draft_index = torch.searchsorted(draft_ids, full_argmax.contiguous())
        draft_index = torch.where(in_draft, draft_index, torch.full_like(draft_index, -1))
    nxt_ok = torch.zeros_like(in_draft)
    nxt_ok[:, :-1] = loss_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    if segments is not None:
        nxt_ok &= next_in_segment(segments)
    return TargetLabels(logits=logits, argmax=torch.where(in_draft, draft_index, -1), valid=nxt_ok & in_draft)


def soft_cross_entropy(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Masked mean over valid slots of -sum_v p_target(v) log q_draft(v).

    draft_logits / target_logits [B, T, Vd]; valid [B, T] bool. Returns a scalar (0 with a
    graph when nothing is valid, so every rank still runs backward)."""
    sel = valid.reshape(-1)
    if not bool(sel.any()):
        return draft_logits.sum() * 0.0
    q = torch.log_softmax(draft_logits.reshape(-1, draft_logits.shape[-1])[sel].float(), dim=-1)
    p = torch.softmax(target_logits.reshape(-1, target_logits.shape[-1])[sel].float(), dim=-1)
    return -(p * q).sum(-1).mean()


def _soft_ce_forward(logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [N], log q [N, V]) in >= float32."""
    logq = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -(probs.to(logq.dtype) * logq).sum(-1), logq


def _soft_ce_backward(
    logq: torch.Tensor, probs: torch.Tensor, grad_ce: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """d ce / d logits = (softmax - p) * grad_ce, in the logits' dtype."""
    return ((logq.exp() - probs.to(logq.dtype)) * grad_ce[:, None].to(logq.dtype)).to(dtype)


def _ce_tv_forward(logits: torch.Tensor, probs: torch.Tensor):
    """(ce [N], tv [N], log q [N, V]): tv = 1 - sum_v min(p(v), q(v))."""
    ce, logq = _soft_ce_forward(logits, probs)
    tv = 1.0 - torch.minimum(probs.to(logq.dtype), logq.exp()).sum(-1)
    return ce, tv, logq


def _ce_tv_backward(logq, probs, grad_ce, grad_tv, dtype):
    """d ce / dz plus d tv / dz: where q < p the overlap takes q, so d overlap / dz_j =
    q_j (1[q_j < p_j] - A) with A = sum of q over those tokens; tv = 1 - overlap."""
    q, p = logq.exp(), probs.to(logq.dtype)
    below = (q < p).to(q.dtype)
    overlap_q = (q * below).sum(-1, keepdim=True)
    grad = (q - p) * grad_ce[:, None].to(q.dtype) + q * (overlap_q - below) * grad_tv[:, None].to(q.dtype)
    return grad.to(dtype)


# name -> (forward, backward); "ce_tv" only runs for train.loss tv / lk
_KERNELS = {"ce": (_soft_ce_forward, _soft_ce_backward), "ce_tv": (_ce_tv_forward, _ce_tv_backward)}

# Below this many logits a compiled kernel never repays its first compile (tests, tiny heads).
_COMPILE_MIN_ELEMENTS = 1 << 22
_compile_failed: list[str] = []  # the error, once a compile has failed in this process


@functools.cache
def _compiled_kernels(name: str):
    # dynamic: the number of loss rows changes every step
    return tuple(torch.compile(kernel, dynamic=True) for kernel in _KERNELS[name])


def _use_compiled(mode: str, logits: torch.Tensor) -> bool:
    if mode == "off" or _compile_failed:
        return False
    if mode == "auto":
        return logits.device.type == "cpu" and logits.numel() >= _COMPILE_MIN_ELEMENTS
    return True


def _run_kernel(name: str, index: int, compiled: bool, *args):
    """Kernel `index` (0 forward, 1 backward) of `_KERNELS[name]`, compiled when asked; a
    compile error falls back to the same math run eagerly for the rest of the process,
    with one warning."""
    eager = _KERNELS[name][index]
    if compiled and not _compile_failed:
        try:
            return _compiled_kernels(name)[index](*args)
        except Exception as err:  # a missing C++ toolchain, an unsupported backend, ...
            _compile_failed.append(f"{type(err).__name__}: {err}")
            log.warning(
                "torch.compile of the soft cross-entropy failed; running it eagerly "
                "(set train.compile_loss=off to skip the attempt): %s",
                _compile_failed[0][:500],
            )
    return eager(*args)


class _SoftCrossEntropyRows(torch.autograd.Function):
    """Per-row soft cross-entropy with its gradient `softmax(z) - p` written by hand:
    autograd's version of -(p * log_softmax(z)).sum(-1) keeps several float32 [N, V]
    buffers alive and makes as many passes over them; this keeps log q only."""

    @staticmethod
    def forward(ctx, logits, probs, compile_mode):
        compiled = _use_compiled(compile_mode, logits)
        with torch.autocast(logits.device.type, enabled=False):
            ce, logq = _run_kernel("ce", 0, compiled, logits, probs)
            top = argmax_rows(logq)
        ctx.save_for_backward(logq, probs)
        ctx.logits_dtype = logits.dtype
        ctx.compiled = compiled
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ce, _grad_top):
        logq, probs = ctx.saved_tensors
        return _run_kernel("ce", 1, ctx.compiled, logq, probs, grad_ce, ctx.logits_dtype), None, None


def soft_cross_entropy_rows(
    logits: torch.Tensor, probs: torch.Tensor, compile_mode: str = "off"
) -> tuple[torch.Tensor, torch.Tensor]:
    """-Σ_v p(v) log softmax(z)(v) per row, and the draft argmax per row.

    logits [N, V] (any float dtype, e.g. bf16 under autocast); probs [N, V] the target
    distribution (rows sum to 1, no gradient); compile_mode the recipe's
    `train.compile_loss` ("auto" / "on" / "off"). Returns (ce [N] in >= float32, with a
    gradient to `logits`; argmax [N] long)."""
    return _SoftCrossEntropyRows.apply(logits, probs, compile_mode)


class _CrossEntropyAndTVRows(torch.autograd.Function):
    """Per-row soft cross-entropy and total variation with one hand-written backward, so
    only log q is kept (as `_SoftCrossEntropyRows`)."""

    @staticmethod
    def forward(ctx, logits, probs, compile_mode):
        compiled = _use_compiled(compile_mode, logits)
        with torch.autocast(logits.device.type, enabled=False):
            ce, tv, logq = _run_kernel("ce_tv", 0, compiled, logits, probs)
            top = argmax_rows(logq)
        ctx.save_for_backward(logq, probs)
        ctx.logits_dtype = logits.dtype
        ctx.compiled = compiled
        ctx.mark_non_differentiable(top)
        return ce, tv, top

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ce, grad_tv, _grad_top):
        logq, probs = ctx.saved_tensors
        grad_ce = torch.zeros_like(logq[:, 0]) if grad_ce is None else grad_ce
        grad_tv = torch.zeros_like(logq[:, 0]) if grad_tv is None else grad_tv
        grad = _run_kernel("ce_tv", 1, ctx.compiled, logq, probs, grad_ce, grad_tv, ctx.logits_dtype)
        return grad, None, None


def loss_terms_rows(
    logits: torch.Tensor, probs: torch.Tensor, loss: LossKind, compile_mode: str = "off"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(ce [N], tv [N] or None, argmax [N]) of `logits` [N, V] against `probs` [N, V]: the
    total variation only when `loss` needs it (tv, lk), so "kl" runs as it always has."""
    if loss == "kl":
        ce, top = soft_cross_entropy_rows(logits, probs, compile_mode)
        return ce, None, top
    return _CrossEntropyAndTVRows.apply(logits, probs, compile_mode)


def lk_lambda(tv: torch.Tensor, group: torch.Tensor, eta: float) -> torch.Tensor:
    """Per row, the LK blend weight exp(-eta · mean acceptance of its group), detached
    (Samarin et al. 2026, arXiv 2602.23881: one weight per draft depth and batch).
    tv [N]; group [N] long, the row's TTT step or P-EAGLE depth, -1 for a row that does
    not count (padding). Acceptance of a row is 1 - tv."""
    alpha = (1.0 - tv.detach()).double()
    counted = group >= 0
    g = group.clamp(min=0)
    n = int(g.max()) + 1 if g.numel() else 1
    sums = torch.zeros(n, dtype=torch.float64, device=tv.device).index_add_(0, g[counted], alpha[counted])
    counts = torch.zeros(n, dtype=torch.float64, device=tv.device).index_add_(
        0, g[counted], torch.ones_like(alpha[counted])
    )
    return torch.exp(-eta * sums / counts.clamp(min=1))[g].to(tv.dtype)


def loss_rows(
    loss: LossKind, ce: torch.Tensor, tv: torch.Tensor | None, group: torch.Tensor, eta: float
) -> torch.Tensor:
    """The per-row training loss [N] of `train.loss` from `loss_terms_rows`' terms: ce (kl),
    tv, or lambda·ce + (1 - lambda)·tv with `lk_lambda`'s weight (lk). The cross-entropy
    stands in for the KL: they differ by the target's entropy, which has no gradient."""
    if loss == "kl":
        return ce
    if loss == "tv":
        return tv
    lam = lk_lambda(tv, group, eta)
    return lam * ce + (1.0 - lam) * tv


def argmax_accuracy(
    draft_logits: torch.Tensor, target_argmax: torch.Tensor, valid: torch.Tensor
) -> tuple[int, int]:
    """(hits, count): draft argmax == target argmax over valid slots."""
    hits = ((draft_logits.argmax(-1) == target_argmax) & valid).sum()
    return int(hits), int(valid.sum())
