"""`train.packing` (DESIGN §3): short samples concatenated into one row train exactly as
the same samples in rows of their own (float64 losses and gradients), and the packed plan
fills its rows."""

import pytest
import torch
from support.tiny_heads import double_head_and_batch, small_head_config

from eyas.core.segments import sample_spans
from eyas.heads.layers import RMSNorm
from eyas.recipe import TrainSection
from eyas.train.batching import collate, collate_packed, pack_rows, plan_epoch
from eyas.train.eagle3 import eagle3_loss
from eyas.train.fastpath import draft_first_lm_head, valid_row_labels
from eyas.train.losses import TargetLabels
from eyas.train.peagle import peagle_loss

LENGTHS = (70, 45, 90)  # the packed row crosses several 64-slot TTT query blocks


def _samples(head, gen, lengths=LENGTHS, vocab=6):
    """Per-sample token ids (from a few tokens, so copy sources abound, inside and across
    samples), loss masks, aux and last states, and target logits."""
    cfg = head.config
    out = []
    for k, n in enumerate(lengths):
        loss_mask = torch.ones(n, dtype=torch.long)
        loss_mask[: n // 5 if k != 1 else 0] = 0  # a prompt (none in the second: its first slot has a label)
        out.append(
            {
                "input_ids": torch.randint(0, vocab, (n,), generator=gen),
                "loss_mask": loss_mask,
                "aux": torch.randn(n, cfg.fc_in_features, generator=gen, dtype=torch.double),
                "last": torch.randn(n, cfg.target_hidden_size, generator=gen, dtype=torch.double),
                "logits": torch.randn(n, cfg.draft_vocab_size, generator=gen, dtype=torch.double),
            }
        )
    return out


def _labels(head, batch, samples, keep_only=None):
    """The labels of `batch`: validity from the trainer's own `valid_row_labels` (so the
    packed row's sample boundaries are its business), logits and argmax laid out from the
    samples'. `keep_only`: the sample whose labels alone count."""
    torch.manual_seed(5)
    cfg = head.config
    lm = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, dtype=torch.double)
    valid = valid_row_labels(
        batch["last"],
        RMSNorm(cfg.target_hidden_size).double(),
        draft_first_lm_head(lm, head.draft_token_ids()),
        batch["loss_mask"],
        batch["attention_mask"],
        segments=batch.get("segments"),
    ).valid
    logits = torch.zeros(*batch["input_ids"].shape, cfg.draft_vocab_size, dtype=torch.double)
    spans = sample_spans(batch["attention_mask"], batch.get("segments"))
    for i, ((row, a, e), s) in enumerate(zip(spans, samples)):
        logits[row, a:e] = s["logits"]
        if keep_only is not None and i != keep_only:
            valid[row, a:e] = False
    return TargetLabels(logits=logits, argmax=logits.argmax(-1), valid=valid)


def _loss_and_grads(head, loss_fn, batch, labels, cfg, seed=0):
    head.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)
    stats = loss_fn(head, batch, labels, cfg, gen)
    stats.loss.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    return stats, grads


def _assert_same(a, b):
    """Losses to 1e-9; gradients to 1e-6: the head's RMSNorm runs in float32 (as the
    target's), so where a norm's float64 input differs in its last bit (a matmul over
    another shape) the gradient behind it differs at float32's rounding. A sample that
    read another would differ at the first digit."""
    (sa, ga), (sb, gb) = a, b
    torch.testing.assert_close(sa.loss, sb.loss, rtol=1e-9, atol=1e-12)
    assert sa.counts == sb.counts and sa.hits == sb.hits
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-6, atol=1e-9, msg=name)


def _compare(head, loss_fn, cfg, per_sample_cfg=None):
    """The packed row against the samples in separate (padded) rows, for the batch's loss
    and for each sample's own loss (its labels alone counting), the latter against the
    sample alone in a batch of one row."""
    samples = _samples(head, torch.Generator().manual_seed(1))
    packed = collate_packed(samples)
    rows = collate(samples)
    assert packed["input_ids"].shape == (1, sum(LENGTHS)) and "segments" not in rows
    _assert_same(
        _loss_and_grads(head, loss_fn, packed, _labels(head, packed, samples), cfg),
        _loss_and_grads(head, loss_fn, rows, _labels(head, rows, samples), cfg),
    )
    cfg = per_sample_cfg or cfg
    for i, s in enumerate(samples):
        alone = collate([s])
        _assert_same(
            _loss_and_grads(head, loss_fn, packed, _labels(head, packed, samples, keep_only=i), cfg),
            _loss_and_grads(head, loss_fn, alone, _labels(head, alone, [s]), cfg),
        )


@pytest.mark.parametrize("window", [None, 3, 40], ids=["full", "window-3", "window-40"])
@pytest.mark.parametrize("copy_weight", [0.0, 0.5], ids=["ttt", "ttt+copy"])
def test_eagle3_packed_row_trains_as_separate_rows(window, copy_weight):
    head, _ = double_head_and_batch(0, 1, 4, sliding_window=window, num_hidden_layers=2)
    cfg = TrainSection(
        compile_loss="off",
        eagle3={"ttt_steps": 3, "copy_attention_weight": copy_weight, "copy_attention_steps": 2},
    )
    _compare(head, eagle3_loss, cfg)


@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=4)], ids=["full", "window-4"])
@pytest.mark.parametrize("segment_length", [None, 32], ids=["one-pass", "segmented"])
def test_peagle_packed_row_trains_as_separate_rows(opts, segment_length):
    """COD samples each sample in row order with the same generator, so the packed row and
    the separate rows draw the same elements and the batch losses compare with COD on. A
    sample alone draws first what the packed row draws after its earlier samples, so the
    per-sample comparison keeps every element (r = r_min = 1) instead."""
    opts = dict(algorithm="peagle", mask_token_id=49, num_hidden_layers=2, **opts)
    head, _ = double_head_and_batch(0, 1, 4, **opts)
    cod = {"num_depths": 3, "cod_r": 0.6, "cod_r_min": 0.3, "segment_length": segment_length}
    keep_all = {**cod, "cod_r": 1.0, "cod_r_min": 1.0}
    _compare(
        head,
        peagle_loss,
        TrainSection(compile_loss="off", peagle=cod),
        TrainSection(compile_loss="off", peagle=keep_all),
    )


def test_no_label_reads_the_next_sample():
    head, _ = double_head_and_batch(0, 1, 4)
    samples = _samples(head, torch.Generator().manual_seed(2))
    for s in samples:
        s["loss_mask"][:] = 1  # the next sample's first token would be a label
    packed = collate_packed(samples)
    valid = _labels(head, packed, samples).valid[0]
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    assert not valid[ends].any()
    assert valid[: ends[0]].all()


def _mix(n=400, seed=0):
    """A ShareGPT-like mix of lengths: mostly short chats, a few long ones."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(40, 600, (n,), generator=g)
    long = torch.randint(2000, 9000, (n // 20,), generator=g)
    return torch.cat([short, long]).tolist()


def test_packed_plan_fills_rows_up_to_batch_tokens():
    lengths, budget = _mix(), 8192
    groups = [list(range(0, 200)), list(range(200, len(lengths)))]
    plan = plan_epoch(lengths, groups, budget, 64, seed=3, epoch=0, packed=True)
    assert sorted(i for row in plan for i in row) == list(range(len(lengths)))
    for row in plan:
        tokens = sum(lengths[i] for i in row)
        assert tokens <= budget or len(row) == 1  # a longer sample alone
        assert all(i < 200 for i in row) or all(i >= 200 for i in row)  # never across groups
    # best fit: no row could have taken the sample that opened a later row of its group
    for g in groups:
        rows = pack_rows(g, lengths, budget)
        room = [budget - sum(lengths[i] for i in r) for r in rows]
        for later, r in enumerate(rows):
            assert all(room[earlier] < lengths[r[0]] for earlier in range(later))
    assert sum(lengths) / (len(plan) * budget) > 0.9
    # bucketed rows of at most 8 samples (the SmolLM2 recipes' max_batch_size) need far more
    unpacked = plan_epoch(lengths, groups, budget, 8, seed=3, epoch=0)
    assert len(plan) < len(unpacked) / 2
    assert plan == plan_epoch(lengths, groups, budget, 64, seed=3, epoch=0, packed=True)
    assert plan != plan_epoch(lengths, groups, budget, 64, seed=3, epoch=1, packed=True)


def test_recipe_packing_is_typed_and_refused_without_offline_features():
    from eyas.recipe import recipe_from_dict

    base = {"name": "p", "run_dir": "/tmp/x"}
    assert not recipe_from_dict(base).train.packing
    assert recipe_from_dict({**base, "train": {"packing": True}}).train.packing
    with pytest.raises(ValueError, match="train.packin"):
        recipe_from_dict({**base, "train": {"packin": True}})
    for features in ("online", "engine"):
        with pytest.raises(ValueError, match="train.packing needs data.features: offline"):
            recipe_from_dict({**base, "data": {"features": features}, "train": {"packing": True}})


def test_positions_restart_at_every_sample():
    """The head's RoPE position of a packed slot is its position inside its own sample, for
    the TTT slots and for P-EAGLE's (anchor, depth) elements alike."""
    from eyas.core.segments import segment_positions, segment_starts
    from eyas.train.peagle import compact

    samples = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n)} for n in (3, 5, 2)]
    packed = collate_packed(samples, pad_to_multiple_of=4)  # 10 slots and 2 of padding
    assert packed["segments"].tolist() == [[0] * 3 + [1] * 5 + [2] * 2 + [-1] * 2]
    pos = segment_positions(packed["segments"])[0, :10]
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    t = 12
    keep = torch.zeros(1, 2 * t, dtype=torch.bool)
    keep[0, :10] = True  # every depth-0 slot
    keep[0, t + 4] = True  # (4, 1): the second sample's slot 1, one deeper
    el = compact(keep, t, row_starts=segment_starts(packed["segments"]))
    assert el.positions[0, :10].tolist() == pos.tolist() and el.positions[0, 10] == 2


def test_budget_probe_times_one_packed_row_of_the_batch():
    """The time budget's probe (train/step_timing.py) times a packing recipe's step on one
    packed row of the batch's samples, their real tokens only."""
    from eyas.train.step_timing import packed_row, synthetic_batch

    lens = [7, 4, 2]
    batch = synthetic_batch(3, 7, 50, 6, 4, "cpu", torch.Generator().manual_seed(0), lengths=lens)
    row = packed_row(batch, lens)
    assert row["segments"].tolist() == [[0] * 7 + [1] * 4 + [2] * 2]
    for key in ("input_ids", "loss_mask", "aux", "last"):
        parts = [batch[key][r, :n] for r, n in enumerate(lens)]
        assert torch.equal(row[key][0], torch.cat(parts)), key


def test_later_epochs_reuse_each_packed_samples_valid_slots():
    """The trainer remembers each sample's valid label slots (by its index) for later epochs;
    in a packed row the sample sits at an offset, and in another epoch another row holds it
    elsewhere: the remembered slots follow it there."""
    from eyas.train.build import FrozenOutput
    from eyas.train.feed import FeatureSource

    torch.manual_seed(3)
    head, _ = double_head_and_batch(0, 1, 4, draft_vocab_size=20)
    cfg = head.config
    lm = torch.randn(cfg.vocab_size, cfg.target_hidden_size, dtype=torch.double)
    output = FrozenOutput(RMSNorm(cfg.target_hidden_size).double(), lm)
    source = FeatureSource(None, list(cfg.aux_layer_ids), output, head)
    samples = _samples(head, torch.Generator().manual_seed(4), lengths=(9, 12, 7))

    def labels(order):
        batch = collate_packed([samples[i] for i in order])
        batch["index"] = torch.tensor(order)
        return source.complete(batch)[1]

    first = labels([0, 1, 2])  # every slot's validity from the whole vocabulary
    again = labels([2, 0, 1])  # remembered, placed at the samples' new offsets
    fresh = FeatureSource(None, list(cfg.aux_layer_ids), output, head)
    batch = collate_packed([samples[i] for i in (2, 0, 1)])
    batch["index"] = torch.tensor([2, 0, 1])
    assert not first.valid.all() and torch.equal(again.valid, fresh.complete(batch)[1].valid)


def _packed_elements(lengths=(9, 6, 11), depths=3):
    from eyas.core.segments import segment_starts
    from eyas.train.peagle import cod_grid, compact

    samples = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n)} for n in lengths]
    batch = collate_packed(samples, pad_to_multiple_of=8)
    t = batch["input_ids"].shape[1]
    keep = cod_grid(
        batch["attention_mask"], depths, 0.7, 0.3, torch.Generator().manual_seed(0), None, batch["segments"]
    )
    return batch, compact(keep, t, row_starts=segment_starts(batch["segments"]))


@pytest.mark.parametrize("window", [None, 3])
def test_peagle_packed_mask_matches_the_reference(window):
    """The dense P-EAGLE mask of a packed row, entry by entry against the reference rule:
    a depth-0 key counts only for queries of its own sample."""
    from eyas.train.masks import peagle_dense_mask, peagle_reference_mask

    batch, el = _packed_elements()
    sample = batch["segments"][0].gather(0, el.anchor[0])
    dense = peagle_dense_mask(el.anchor, el.depth, el.real, window, el.start)[0, 0]
    assert torch.equal(dense, peagle_reference_mask(el.anchor[0], el.depth[0], el.real[0], window, sample))
    real = el.real[0]
    crosses = (sample[:, None] != sample[None, :]) & real[:, None] & real[None, :]
    assert crosses.any() and not (dense & crosses).any()


def test_peagle_packed_flex_block_mask_gives_the_dense_mask_logits():
    """The CUDA path (flex attention over the block mask, `start` included) against SDPA
    with the dense mask on a packed row; on CPU, forward only (flex has no CPU backward)."""
    from eyas.heads.algorithms import build_head
    from eyas.train.masks import peagle_block_mask, peagle_dense_mask
    from eyas.train.peagle import element_inputs

    torch.manual_seed(0)
    head = build_head(small_head_config(algorithm="peagle", mask_token_id=49, num_hidden_layers=2))
    batch, el = _packed_elements()
    aux = torch.randn(*batch["input_ids"].shape, head.config.fc_in_features)
    with torch.no_grad():
        tokens, hidden = element_inputs(head, el, batch["input_ids"], aux)
        dense, flex = (
            head.forward_step(
                tokens,
                hidden,
                el.positions,
                head.new_cache(),
                mask(el.anchor, el.depth, el.real, None, el.start),
            )[0]
            for mask in (peagle_dense_mask, peagle_block_mask)
        )
    torch.testing.assert_close(flex[el.real], dense[el.real], rtol=1e-5, atol=1e-5)
