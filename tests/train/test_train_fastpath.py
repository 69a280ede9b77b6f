"""The valid-slot hot path equals the reference labels and TTT loss (values, gradients,
accuracy counts)."""

import pytest
import torch
from support.tiny_heads import double_head_and_batch

from eyas.heads.layers import RMSNorm
from eyas.heads.vocab import build_vocab_map
from eyas.train.fastpath import draft_first_lm_head, ttt_loss_valid_rows, valid_row_labels
from eyas.train.losses import target_labels
from eyas.train.reference import ttt_loss


def _setup(opts, vd):
    b, t = 3, 9
    head, batch = double_head_and_batch(0, b, t, lengths=(9, 6, 2), draft_vocab_size=vd, **opts)
    cfg = head.config
    vt, ht = cfg.vocab_size, cfg.target_hidden_size
    if vd < vt:
        vmap = build_vocab_map(torch.rand(vt), vd)
        head.set_vocab_map(vmap.d2t, vmap.t2d)
    am = batch["attention_mask"]
    lm = (torch.rand(b, t) > 0.3).long() * am
    batch.update(loss_mask=lm, last=torch.randn(b, t, ht, dtype=torch.double))
    norm = RMSNorm(ht).double()
    w = torch.randn(vt, ht, dtype=torch.double)
    t2d = head.t2d if cfg.uses_vocab_map else None
    args = (batch["last"], norm, w, head.draft_token_ids(), t2d, lm, am)
    return head, batch, args


@pytest.mark.parametrize("loss", ["kl", "tv", "lk"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "loss-in-chunks"])
@pytest.mark.parametrize("vd", [50, 20])
@pytest.mark.parametrize(
    "opts",
    [dict(), dict(norm_output=True, fc_norm=True), dict(num_hidden_layers=2)],
    ids=["plain", "norm_output", "two_layers"],
)
def test_fast_path_equals_reference(opts, vd, chunked, loss, monkeypatch):
    """Every `train.loss` on the valid-row path (its LM head in chunks or whole) has the
    value and float64 gradients of the dense definition (train/reference.py) over 4 TTT
    steps."""
    if chunked:  # the LM head and loss of long samples run in chunks recomputed in the backward
        monkeypatch.setattr("eyas.train.fastpath.LOSS_CHUNK_ROWS", 3)
    head, batch, args = _setup(opts, vd)
    ref_labels = target_labels(*args)
    last, norm, w, draft_ids, _, lm, am = args
    fast_labels = valid_row_labels(last, norm, draft_first_lm_head(w, draft_ids), lm, am)
    assert torch.equal(ref_labels.valid, fast_labels.valid)
    assert torch.equal(ref_labels.argmax[ref_labels.valid], fast_labels.argmax[fast_labels.valid])
    torch.testing.assert_close(ref_labels.logits[ref_labels.valid], fast_labels.logits[fast_labels.valid])

    # a λ far from 0 and 1, so both LK terms reach the gradient
    ref = ttt_loss(head, batch, ref_labels, 4, 0.8, loss=loss, lk_eta=1.5)
    g_ref = torch.autograd.grad(ref.loss, [p for p in head.parameters() if p.requires_grad])
    fast = ttt_loss_valid_rows(head, batch, fast_labels, 4, 0.8, loss=loss, lk_eta=1.5)
    g_fast = torch.autograd.grad(fast.loss, [p for p in head.parameters() if p.requires_grad])
    torch.testing.assert_close(fast.loss, ref.loss, check_dtype=False)
    assert fast.hits == ref.hits and fast.counts == ref.counts
    for a, b in zip(g_ref, g_fast):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("compile_mode", ["off", "on"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_soft_cross_entropy_rows_matches_autograd(dtype, compile_mode):
    """The hand-written backward equals autograd's gradient of -(p * log_softmax(z)).sum(-1),
    per-row weights included, run eagerly and through torch.compile; the argmax is the
    row's top logit."""
    from eyas.train import losses
    from eyas.train.losses import soft_cross_entropy_rows

    torch.manual_seed(3)
    z = (3 * torch.randn(6, 256)).to(dtype)
    p = torch.softmax(torch.randn(6, 256, dtype=torch.float64), -1).float()
    w = torch.rand(6)
    mine = z.clone().requires_grad_()
    ce, top = soft_cross_entropy_rows(mine, p, compile_mode)
    assert not losses._compile_failed, losses._compile_failed
    (ce * w).sum().backward()
    ref = z.clone().to(torch.promote_types(dtype, torch.float32)).requires_grad_()
    ref_ce = -(p.to(ref.dtype) * torch.log_softmax(ref, -1)).sum(-1)
    (ref_ce * w.to(ref.dtype)).sum().backward()
    torch.testing.assert_close(ce, ref_ce.detach())
    torch.testing.assert_close(mine.grad, ref.grad.to(dtype))
    assert torch.equal(top, z.float().argmax(-1))


def test_a_failed_loss_compile_falls_back_to_the_same_math_with_one_warning(monkeypatch, caplog):
    from eyas.train import losses

    def broken(name):
        def fail(*args):
            raise RuntimeError("no C++ compiler")

        return fail, fail

    monkeypatch.setattr(losses, "_compiled_kernels", broken)
    monkeypatch.setattr(losses, "_compile_failed", [])
    torch.manual_seed(4)
    z, p = torch.randn(5, 130), torch.softmax(torch.randn(5, 130), -1)
    with caplog.at_level("WARNING", logger="eyas.train.losses"):
        runs = []
        for _ in range(2):
            logits = z.clone().requires_grad_()
            ce, top = losses.soft_cross_entropy_rows(logits, p, "on")
            ce.sum().backward()
            runs.append((ce.detach(), top, logits.grad))
    eager = z.clone().requires_grad_()
    ce, top = losses.soft_cross_entropy_rows(eager, p, "off")
    ce.sum().backward()
    for got in runs:
        torch.testing.assert_close(got[0], ce.detach())
        assert torch.equal(got[1], top)
        torch.testing.assert_close(got[2], eager.grad)
    warnings = [
        r for r in caplog.records if "torch.compile of the soft cross-entropy failed" in r.getMessage()
    ]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()


def test_auto_loss_compilation_only_for_large_cpu_rows():
    """auto compiles only where a compile repays itself: CPU logits of >= 4M elements."""
    from eyas.train.losses import _use_compiled

    big, small = torch.empty(1024, 8192), torch.empty(64, 8192)
    assert _use_compiled("auto", big) and not _use_compiled("auto", small)
    assert _use_compiled("on", small) and not _use_compiled("off", big)
    assert not _use_compiled("auto", torch.empty(1024, 8192, device="meta"))


def test_argmax_rows_is_the_first_maximum():
    from eyas.core.sampling import argmax_rows

    torch.manual_seed(5)
    x = torch.randn(37, 1024)
    x[3, 700] = x[3, 5] = 99.0  # a tie across blocks: the first index wins
    x[4, 130] = x[4, 129] = 99.0  # a tie inside a block
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x)[3] == 5 and argmax_rows(x)[4] == 129
    odd = torch.randn(4, 1000)  # not a multiple of the block: plain argmax
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(-1))


def test_draft_first_labels_validity_and_ties():
    """A slot counts when a draft token reaches the target's top logit: not when only a
    token outside the draft vocabulary does, yes on an exact tie; the argmax is the draft
    index of that token."""
    from torch import nn

    vt = 6
    weight = torch.eye(vt)  # logit of token v = the hidden state's v-th entry
    draft_ids = torch.tensor([1, 3, 4])  # draft index 0, 1, 2
    last = torch.tensor(
        [
            [
                [0.0, 0, 0, 0, 0, 0],
                [0, 0, 0, 5, 0, 0],  # top: token 3 (draft index 1)
                [0, 0, 0, 2, 0, 7],  # top: token 5, outside the draft vocabulary
                [0, 0, 0, 0, 4, 4],  # tie of token 4 (draft) and 5 (outside)
                [0, 0, 0, 0, 0, 0],
            ]
        ]
    )
    mask = torch.ones(1, 5, dtype=torch.long)
    labels = valid_row_labels(last, nn.Identity(), draft_first_lm_head(weight, draft_ids), mask, mask)
    # slot s is labelled from the state at s (token s+1 real and in the loss mask); the last slot has none
    assert labels.valid[0].tolist() == [True, True, False, True, False]
    assert labels.argmax[0, 1:4].tolist() == [1, -1, 2]
    torch.testing.assert_close(labels.logits[0, 1], torch.tensor([0.0, 5.0, 0.0]))


def test_padding_a_batch_to_a_multiple_changes_neither_loss_nor_gradients():
    """`train.pad_to_multiple_of` adds right-padding columns; they carry no loss and no
    token attends to them."""
    from eyas.train.batching import collate

    head, batch, args = _setup({}, 20)
    last, norm, w, draft_ids, _, lm, am = args
    lm_head = draft_first_lm_head(w, draft_ids)
    samples = [
        {
            "input_ids": batch["input_ids"][r, :n],
            "loss_mask": lm[r, :n],
            "aux": batch["aux"][r, :n],
            "last": last[r, :n],
        }
        for r, n in enumerate(am.sum(1).tolist())
    ]
    results = []
    for multiple in (1, 16):
        b = collate(samples, pad_to_multiple_of=multiple)
        assert b["input_ids"].shape[1] == (9 if multiple == 1 else 16)
        labels = valid_row_labels(b["last"], norm, lm_head, b["loss_mask"], b["attention_mask"])
        stats = ttt_loss_valid_rows(head, b, labels, 4, 0.8)
        grads = torch.autograd.grad(stats.loss, [p for p in head.parameters() if p.requires_grad])
        results.append((stats, grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.loss, b.loss)
    assert a.hits == b.hits and a.counts == b.counts
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)


def test_known_validity_multiplies_only_the_draft_rows_and_gives_the_same_labels():
    """A later epoch passes the validity an earlier one found: the labels are the same,
    and the non-draft rows of the LM head are never read (NaN there changes nothing)."""
    _, _, args = _setup({}, 20)
    last, norm, w, draft_ids, _, lm, am = args
    lm_head = draft_first_lm_head(w, draft_ids)
    first = valid_row_labels(last, norm, lm_head, lm, am)
    label_slots = int((lm[:, 1:].bool() & am[:, 1:].bool()).sum())
    assert 0 < int(first.valid.sum()) < label_slots  # some targets' argmax lies outside the draft vocabulary
    poisoned = lm_head.weight.clone()
    poisoned[lm_head.draft_size :] = float("nan")
    again = valid_row_labels(
        last, norm, type(lm_head)(poisoned, lm_head.draft_size), lm, am, known_valid=first.valid
    )
    assert torch.equal(again.valid, first.valid) and torch.equal(again.argmax, first.argmax)
    torch.testing.assert_close(again.logits, first.logits)


def test_feature_source_remembers_validity_per_split_and_sample():
    """The trainer's label step: the first epoch decides validity over the whole
    vocabulary and remembers it per (split, sample); the next epoch's batch of the same
    samples, in another order, gets the same labels from the draft rows alone."""
    from eyas.train.build import FrozenOutput
    from eyas.train.feed import FeatureSource

    head, batch, args = _setup({}, 20)
    last, norm, w, draft_ids, _, lm, am = args
    features = FeatureSource(None, [1, 2, 3], FrozenOutput(norm=norm, lm_head_weight=w), head)
    first_batch = dict(batch, index=torch.tensor([7, 3, 5]))
    _, first = features.complete(dict(first_batch))
    assert sorted(features._valid) == [("train", 3), ("train", 5), ("train", 7)]
    features.lm_head.weight[features.lm_head.draft_size :] = float("nan")  # now only a remembered split works
    order = torch.tensor([2, 0, 1])
    second_batch = {k: v[order] for k, v in first_batch.items()}
    _, second = features.complete(second_batch)
    assert torch.equal(second.valid, first.valid[order]) and torch.equal(second.argmax, first.argmax[order])
    torch.testing.assert_close(second.logits, first.logits[order])
    # the eval split's sample 3 is another sample: not served from the train split's
    # memory (the whole vocabulary is read, NaN rows included, so nothing comes out valid)
    _, other = features.complete(dict(first_batch), split="eval")
    assert not other.valid.any() and ("eval", 3) in features._valid


def test_label_prompts_labels_every_real_slot_of_training_samples_only():
    """`train.label_prompts`: a training batch gets the target's label at every real slot
    whose next token is real, prompt slots included, with the same label as where the loss
    mask already held; the held-out split keeps the reply-only mask."""
    from eyas.train.build import FrozenOutput
    from eyas.train.feed import FeatureSource

    head, batch, args = _setup({}, 50)  # the whole vocabulary: every labelled slot counts
    last, norm, w, draft_ids, _, lm, am = args
    output = FrozenOutput(norm=norm, lm_head_weight=w)
    replies_only = FeatureSource(None, [1, 2, 3], output, head)
    with_prompts = FeatureSource(None, [1, 2, 3], output, head, label_prompts=True)
    _, base = replies_only.complete(dict(batch))
    _, wide = with_prompts.complete(dict(batch))
    next_real = torch.zeros_like(am, dtype=torch.bool)
    next_real[:, :-1] = am[:, 1:].bool()
    next_in_mask = torch.zeros_like(next_real)
    next_in_mask[:, :-1] = lm[:, 1:].bool()
    assert torch.equal(base.valid, next_in_mask) and torch.equal(wide.valid, next_real)
    assert wide.valid.sum() > base.valid.sum()
    torch.testing.assert_close(wide.logits[base.valid], base.logits[base.valid])
    _, held_out = with_prompts.complete(dict(batch), split="eval")
    assert torch.equal(held_out.valid, base.valid)
