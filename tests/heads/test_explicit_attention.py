"""explicit_attention: the CPU attention of the TTT blocks, checked against fused SDPA."""

import pytest
import torch
import torch.nn.functional as F

from eyas.heads.explicit_attention import explicit_attention


def _inputs(dtype, b=2, h=6, hkv=2, tq=5, tk=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(b, n, t, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        for n, t in ((h, tq), (hkv, tk), (hkv, tk))
    )
    allowed = torch.rand(b, 1, tq, tk, generator=g) < 0.6
    allowed[..., 0] = True  # every row sees one key
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return q, k, v, allowed, bias


def _grads(out, tensors, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out.double() * weight).sum().backward()
    return [t.grad.double() for t in tensors]


def test_values_and_gradients_equal_sdpa_in_float64():
    q, k, v, allowed, bias = _inputs(torch.float64)
    got = explicit_attention(q, k, v, bias, 0.3)
    got_grads = _grads(got, (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=allowed, scale=0.3, enable_gqa=True)
    want_grads = _grads(want, (q2, k2, v2))
    torch.testing.assert_close(got, want)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, msg=f"grad of {name}")


def test_bfloat16_stays_within_bf16_error_of_the_exact_result():
    q, k, v, allowed, bias = _inputs(torch.bfloat16)
    got = explicit_attention(q, k, v, bias, 0.3)
    assert got.dtype == torch.bfloat16
    got_grads = _grads(got, (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=allowed, scale=0.3, enable_gqa=True)
    want_grads = _grads(want, (q2, k2, v2))
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
    for name, a, b in zip("qkv", got_grads, want_grads):
        scale = b.abs().max()
        assert (a - b).abs().max() <= 3e-2 * scale, f"grad of {name}"


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 3), (4, 1)])
def test_query_head_reads_the_kv_head_enable_gqa_pairs_it_with(h, hkv):
    q, k, v, allowed, bias = _inputs(torch.float64, h=h, hkv=hkv)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=allowed, scale=0.5
    )
    torch.testing.assert_close(explicit_attention(q, k, v, bias, 0.5), want)
