"""EAGLE-3 head and the TTT unroll: the mask, and train/serve equality (the logits the
trainer computes at step k, slot t equal those of the KV-cache drafting path)."""

import pytest
import torch
from support.tiny_heads import double_head_and_batch, small_head_config

from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.layers import TTTMask
from eyas.train.batching import shift_left
from eyas.train.masks import ttt_dense_mask, ttt_reference_mask
from eyas.train.reference import ttt_unroll


@pytest.mark.parametrize("window", [None, 1, 2, 4])
@pytest.mark.parametrize("t,k", [(1, 0), (4, 0), (5, 1), (6, 3)])
def test_ttt_dense_mask_matches_reference(t, k, window):
    dense = ttt_dense_mask(torch.ones(1, t), k, window)[0, 0]
    assert torch.equal(dense, ttt_reference_mask(t, k, window))
    if window is not None:  # every query still sees its own key
        assert dense[:, -t:].diagonal().all() if k else dense.diagonal().all()


def test_ttt_dense_mask_hides_padding():
    am = torch.tensor([[1, 1, 1, 0]])
    dense = ttt_dense_mask(am, 2)[0, 0]
    assert not dense[:, 3].any() and not dense[3].any()


OPTIONS = [
    dict(),
    dict(norm_before_residual=True),
    dict(fc_norm=True, norm_output=True),
    dict(norm_before_fc=True),
    dict(num_hidden_layers=2),
    dict(sliding_window=3),
    dict(sliding_window=2, num_hidden_layers=2),
]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_ttt_attention_equals_dense_reference_mask(opts, padding):
    """The trainer's TTT attention (causal step 0 for right padding, its own masks
    otherwise) equals SDPA over the flattened key axis with the brute-force-checked dense
    mask, on every real slot."""
    b, t, steps = 2, 7, 4
    head, batch = double_head_and_batch(0, b, t, lengths=(7, 5), left=padding == "left", **opts)
    ids, am, aux = batch["input_ids"], batch["attention_mask"], batch["aux"]
    fast = [lg for _, lg in ttt_unroll(head, ids, am, aux, steps)]
    # dense reference: one cache, keys concatenated, the dense TTT mask per step
    cache = head.new_cache()
    hid = head.combine_aux(aux)
    pos = torch.arange(t)[None].expand(b, t)
    for k in range(steps):
        dense = ttt_dense_mask(am, k, head.config.sliding_window)
        lg, hid = head.forward_step(shift_left(ids, 1 + k, 0), hid, pos + k, cache, dense)
        real = am.bool()
        torch.testing.assert_close(fast[k][real], lg[real], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_train_serve_equality(opts):
    """TTT step k at slot t == the drafting path's (k+1)-th draft from slot t, fed the same
    teacher-forced tokens."""
    t, steps = 9, 4
    head, batch = double_head_and_batch(1, 1, t, **opts)
    ids, aux = batch["input_ids"], batch["aux"]
    train_logits = [lg for _, lg in ttt_unroll(head, ids, batch["attention_mask"], aux, steps)]
    for slot in range(t - steps):
        cache = head.new_cache()
        tokens = ids[:, 1 : slot + 2]  # step-0 entries for slots 0..slot carry x_{s+1}
        logits, hid = head.forward_step(
            tokens, head.combine_aux(aux[:, : slot + 1]), torch.arange(slot + 1)[None], cache
        )
        serve = [logits[:, -1]]
        hid = hid[:, -1:]
        for k in range(1, steps):
            tok = ids[:, slot + 1 + k : slot + 2 + k]
            logits, hid = head.forward_step(tok, hid, torch.tensor([[slot + k]]), cache)
            serve.append(logits[:, -1])
        for k in range(steps):
            torch.testing.assert_close(train_logits[k][0, slot], serve[k][0], rtol=1e-9, atol=1e-9)


def test_draft_leaves_only_step0_entries_in_cache():
    head = Eagle3Head(small_head_config(draft_vocab_size=20))
    cache = head.new_cache()
    ids, logits = head.draft(
        cache, torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 72), torch.arange(6)[None], k=4
    )
    assert ids.shape == (1, 4) and logits.shape == (1, 4, 20)
    assert cache.length == 6
    ids2, _ = head.draft(
        cache, torch.randint(0, 50, (1, 2)), torch.randn(1, 2, 72), torch.arange(6, 8)[None], k=3
    )
    assert cache.length == 8 and ids2.shape == (1, 3)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("window", [None, 2, 4])
@pytest.mark.parametrize("block", [2, 3, 64])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_blocked_ttt_attention_equals_dense_mask(block, padding, window, recompute, monkeypatch):
    """Query blocks of any size (a ragged last one included) give the attention of SDPA
    over the whole flattened key axis under the dense TTT mask, on real slots; so do
    blocks recomputed in the backward (long sequences), gradients included."""
    import torch.nn.functional as F

    from eyas.heads import layers
    from eyas.heads.layers import LayerCache, _ttt_attention

    if recompute:
        monkeypatch.setattr(layers, "RECOMPUTE_FROM", 1)

    torch.manual_seed(2)
    b, h, hkv, t, d, k = 2, 4, 2, 7, 8, 3
    am = torch.ones(b, t, dtype=torch.long)
    if padding == "right":
        am[1, 5:] = 0
    else:
        am[1, :2] = 0
    q = torch.randn(b, h, t, d, dtype=torch.double, requires_grad=True)
    cache = LayerCache()
    for _ in range(k + 1):
        cache.append(
            torch.randn(b, hkv, t, d, dtype=torch.double, requires_grad=True),
            torch.randn(b, hkv, t, d, dtype=torch.double, requires_grad=True),
        )
    leaves = [q, *cache.k, *cache.v]
    got = _ttt_attention(q, cache, TTTMask(am, block, window), 0.3)
    keys, values = torch.cat(cache.k, 2), torch.cat(cache.v, 2)
    want = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=ttt_dense_mask(am, k, window), scale=0.3, enable_gqa=True
    )
    real = am.bool()[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real])
    # gradients too, of a loss over the real query slots only (padding queries carry none)
    weight = torch.randn(got.shape, dtype=torch.double, generator=torch.Generator().manual_seed(5)) * real
    grads_got = torch.autograd.grad((got * weight).sum(), leaves)
    grads_want = torch.autograd.grad((want * weight).sum(), leaves)
    for i, (a, w) in enumerate(zip(grads_got, grads_want)):
        torch.testing.assert_close(a, w, msg=f"gradient of leaf {i}")
