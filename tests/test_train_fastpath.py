"""The valid-slot hot path equals the reference labels and TTT loss (values, gradients,
accuracy counts)."""

import pytest
import torch

from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.layers import RMSNorm
from eyas.heads.vocab import build_vocab_map
from eyas.train.fastpath import draft_first_lm_head, ttt_loss_valid_rows, valid_row_labels
from eyas.train.losses import target_labels
from eyas.train.ttt import ttt_loss


def _setup(opts, vd):
    torch.manual_seed(0)
    vt, ht = 50, 24
    cfg = DraftHeadConfig(hidden_size=32, target_hidden_size=ht, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=vt, draft_vocab_size=vd, aux_layer_ids=[1, 2, 3],
                          target_num_layers=4, **opts)
    head = Eagle3Head(cfg).double()
    if vd < vt:
        vmap = build_vocab_map(torch.rand(vt), vd)
        head.set_vocab_map(vmap.d2t, vmap.t2d)
    b, t = 3, 9
    ids = torch.randint(0, vt, (b, t))
    am = torch.ones(b, t, dtype=torch.long)
    am[1, 6:] = 0
    am[2, 2:] = 0
    lm = (torch.rand(b, t) > 0.3).long() * am
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "aux": torch.randn(b, t, 3 * ht, dtype=torch.double),
             "last": torch.randn(b, t, ht, dtype=torch.double)}
    norm = RMSNorm(ht).double()
    w = torch.randn(vt, ht, dtype=torch.double)
    t2d = head.t2d if cfg.uses_vocab_map else None
    args = (batch["last"], norm, w, head.draft_token_ids(), t2d, lm, am)
    return head, batch, args


@pytest.mark.parametrize("vd", [50, 20])
@pytest.mark.parametrize("opts", [dict(), dict(norm_output=True, fc_norm=True), dict(num_hidden_layers=2)],
                         ids=["plain", "norm_output", "two_layers"])
def test_fast_path_equals_reference(opts, vd):
    head, batch, args = _setup(opts, vd)
    ref_labels = target_labels(*args)
    last, norm, w, draft_ids, _, lm, am = args
    fast_labels = valid_row_labels(last, norm, draft_first_lm_head(w, draft_ids), lm, am)
    assert torch.equal(ref_labels.valid, fast_labels.valid)
    assert torch.equal(ref_labels.argmax[ref_labels.valid], fast_labels.argmax[fast_labels.valid])
    torch.testing.assert_close(ref_labels.logits[ref_labels.valid], fast_labels.logits[fast_labels.valid])

    ref = ttt_loss(head, batch, ref_labels, 4, 0.8)
    g_ref = torch.autograd.grad(ref.loss, [p for p in head.parameters() if p.requires_grad])
    fast = ttt_loss_valid_rows(head, batch, fast_labels, 4, 0.8)
    g_fast = torch.autograd.grad(fast.loss, [p for p in head.parameters() if p.requires_grad])
    torch.testing.assert_close(fast.loss, ref.loss, check_dtype=False)
    assert fast.hits == ref.hits and fast.counts == ref.counts
    for a, b in zip(g_ref, g_fast):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_soft_cross_entropy_rows_matches_autograd(dtype):
    """The hand-written backward equals autograd's gradient of -(p * log_softmax(z)).sum(-1),
    per-row weights included; the argmax is the row's top logit."""
    from eyas.train.losses import soft_cross_entropy_rows

    torch.manual_seed(3)
    z = (3 * torch.randn(6, 40)).to(dtype)
    p = torch.softmax(torch.randn(6, 40, dtype=torch.float64), -1).float()
    w = torch.rand(6)
    mine = z.clone().requires_grad_()
    ce, top = soft_cross_entropy_rows(mine, p)
    (ce * w).sum().backward()
    ref = z.clone().to(torch.promote_types(dtype, torch.float32)).requires_grad_()
    ref_ce = -(p.to(ref.dtype) * torch.log_softmax(ref, -1)).sum(-1)
    (ref_ce * w.to(ref.dtype)).sum().backward()
    torch.testing.assert_close(ce, ref_ce.detach())
    torch.testing.assert_close(mine.grad, ref.grad.to(dtype))
    assert torch.equal(top, z.float().argmax(-1))


def test_draft_first_labels_validity_and_ties():
    """A slot counts when a draft token reaches the target's top logit: not when only a
    token outside the draft vocabulary does, yes on an exact tie; the argmax is the draft
    index of that token."""
    from torch import nn

    vt, ht = 6, 6
    weight = torch.eye(vt)  # logit of token v = the hidden state's v-th entry
    draft_ids = torch.tensor([1, 3, 4])  # draft index 0, 1, 2
    last = torch.tensor([[[0.0, 0, 0, 0, 0, 0],
                          [0, 0, 0, 5, 0, 0],   # top: token 3 (draft index 1)
                          [0, 0, 0, 2, 0, 7],   # top: token 5, outside the draft vocabulary
                          [0, 0, 0, 0, 4, 4],   # tie of token 4 (draft) and 5 (outside)
                          [0, 0, 0, 0, 0, 0]]])
    mask = torch.ones(1, 5, dtype=torch.long)
    labels = valid_row_labels(last, nn.Identity(), draft_first_lm_head(weight, draft_ids), mask, mask)
    # slot s is labelled from the state at s (token s+1 real and in the loss mask); the last slot has none
    assert labels.valid[0].tolist() == [True, True, False, True, False]
    assert labels.argmax[0, 1:4].tolist() == [1, -1, 2]
    torch.testing.assert_close(labels.logits[0, 1], torch.tensor([0.0, 5.0, 0.0]))
