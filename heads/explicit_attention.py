"""Attention as two matmuls around a float32 softmax, with its backward written out.

For the training-time-test blocks on CPU (64 queries against a few hundred keys), the
fused SDPA kernel's backward costs ~10x its forward and ~3x this whole function
(measured fwd+bwd, B=8, 9 heads, 64x576 keys, bf16: 35 ms vs 12 ms). The price is the
probabilities `[B, H, Tq, Tk]` kept for backward (bf16 under autocast), which a query
block keeps small. Precision is that of the Hugging Face models' eager attention:
scores from a matmul in the input dtype, softmax in float32.
"""

from __future__ import annotations

import torch


class _ExplicitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        b, h, tq, d = q.shape
        kv = k.shape[1]
        g = h // kv
        # heads h = j*g .. j*g+g-1 share kv head j (enable_gqa's grouping): fold them into rows
        qg = q.reshape(b, kv, g * tq, d)
        acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
        scores = torch.matmul(qg, k.transpose(-1, -2)).to(acc).view(b, kv, g, tq, -1)
        probs = torch.softmax(scores.mul_(scale).add_(bias), dim=-1).to(q.dtype).view(b, kv, g * tq, -1)
        out = torch.matmul(probs, v)
        ctx.save_for_backward(qg, k, v, probs, out)
        ctx.scale = scale
        return out.view(b, h, tq, d)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        qg, k, v, probs, out = ctx.saved_tensors
        b, kv, rows, d = qg.shape
        go = grad_out.reshape(b, kv, rows, d).to(v.dtype)
        grad_v = torch.matmul(probs.transpose(-1, -2), go)
        acc = torch.promote_types(qg.dtype, torch.float32)
        delta = (go.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dP * P) = rowsum(dO * O)
        grad_scores = torch.matmul(go, v.transpose(-1, -2)).to(acc).sub_(delta).mul_(probs.to(acc))
        grad_scores = grad_scores.mul_(ctx.scale).to(qg.dtype)
        grad_q = torch.matmul(grad_scores, k).view(grad_out.shape)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), qg)
        return grad_q, grad_k, grad_v, None, None


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) v with grouped-query heads.

    q [B, H, Tq, d]; k, v [B, Hkv, Tk, d] with H a multiple of Hkv (query head h reads kv
    head h // (H / Hkv)); bias [B|1, 1, Tq, Tk] float, additive (-inf = masked; every row
    needs one finite entry). Returns [B, H, Tq, d] in q's dtype."""
    return _ExplicitAttention.apply(q, k, v, bias.unsqueeze(2), scale)
