"""Copy supervision of the EAGLE-3 head's attention (train/copy_attention.py)."""

import pytest
import torch

from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head
from eyas.train.copy_attention import copy_attention_loss, copy_attention_targets


def _ones(ids):
    return torch.ones_like(ids, dtype=torch.bool)


def test_target_is_the_slot_whose_token_comes_next():
    # slot t reads x_{t+1}; its label is x_{t+2}
    ids = torch.tensor([[5, 1, 2, 3, 4, 9, 1, 2, 3, 4, 7]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids))[0].tolist()
    # slot 6 reads "2" after "1" and must predict 3: slot 2 reads "3" (x_3) and holds x_2 = 2
    assert got[6] == 2 and got[7] == 3
    # slot 8 reads "4" (after "3"); "4" was followed by 9 before, the label is 7: no source
    assert got[8] == -1
    # nothing before the repeat starts
    assert all(g == -1 for g in got[:6])


def test_target_needs_the_previous_token_to_match_too():
    # "2" recurs with a different token before it: one shared token is not a copy
    ids = torch.tensor([[1, 2, 3, 8, 2, 3, 5]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids))[0].tolist()
    assert got == [-1] * 7
    assert copy_attention_targets(ids, _ones(ids), _ones(ids), min_match=1)[0, 3] == 1


def test_latest_source_wins_and_labels_gate_queries():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids))[0].tolist()
    assert got[6] == 4  # reads "2" after "1", label 3: slots 1 and 4 qualify, 4 is later
    valid = _ones(ids)
    valid[0, 7] = False  # slot 6's label is slot 7's
    assert copy_attention_targets(ids, valid, _ones(ids))[0, 6] == -1


def test_padding_is_never_a_source_or_a_query():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    am = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    got = copy_attention_targets(ids, am.bool(), am)
    assert got[0, 3] == 1 and (got[0, 4:] == -1).all()
    # a run of one token: the source is the query slot itself (its own key is visible)
    assert got[1, 1:6].tolist() == [1, 2, 3, 4, 5]


def _cfg():
    return DraftHeadConfig(hidden_size=32, target_hidden_size=24, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=64, vocab_size=64, draft_vocab_size=64,
                           aux_layer_ids=[1, 2, 3], target_num_layers=4, rms_norm_eps=1e-6, fc_norm=True)


def _copy_batch(gen, table, b=8, t=48):
    """Random tokens that repeat with a per-sample period; aux_s encodes x_s."""
    ids = torch.randint(4, 64, (b, t), generator=gen)
    for i in range(b):
        p = int(torch.randint(3, t // 2, (), generator=gen))
        for j in range(p, t):
            ids[i, j] = ids[i, j - p]
    aux = table[ids] + 0.1 * torch.randn(b, t, table.shape[1], generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "aux": aux}


def _source_probability(head, batch):
    """Head 0's attention probability on the copy source (geometric mean over queries)."""
    targets = copy_attention_targets(batch["input_ids"], _ones(batch["input_ids"]), batch["attention_mask"])
    assert (targets >= 0).sum() > 50
    with torch.no_grad():
        return float(torch.exp(-copy_attention_loss(head, batch, targets)))


def test_supervision_teaches_head_zero_to_find_the_copy_source():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    head = Eagle3Head(_cfg())
    table = torch.randn(64, 3 * 24, generator=gen)
    held_out = _copy_batch(torch.Generator().manual_seed(1), table)
    before = _source_probability(head, held_out)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        batch = _copy_batch(gen, table)
        targets = copy_attention_targets(batch["input_ids"], _ones(batch["input_ids"]), batch["attention_mask"])
        loss = copy_attention_loss(head, batch, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _source_probability(head, held_out)
    assert before < 0.1 and after > 0.4, (before, after)


def test_loss_reaches_only_what_head_zero_reads():
    head = Eagle3Head(_cfg())
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen))
    targets = copy_attention_targets(batch["input_ids"], _ones(batch["input_ids"]), batch["attention_mask"])
    copy_attention_loss(head, batch, targets).backward()
    attn = head.layers[0].self_attn
    d = attn.head_dim
    assert attn.q_proj.weight.grad[:d].abs().sum() > 0 and attn.q_proj.weight.grad[d:].abs().sum() == 0
    assert attn.k_proj.weight.grad[:d].abs().sum() > 0 and attn.k_proj.weight.grad[d:].abs().sum() == 0
    assert head.fc.weight.grad.abs().sum() > 0
    assert attn.v_proj.weight.grad is None and head.lm_head.weight.grad is None


def test_no_copy_source_gives_a_zero_loss_that_still_backpropagates():
    head = Eagle3Head(_cfg())
    ids = torch.arange(4, 20)[None]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "aux": torch.randn(1, 16, 72)}
    targets = copy_attention_targets(ids, _ones(ids), batch["attention_mask"])
    assert (targets == -1).all()
    loss = copy_attention_loss(head, batch, targets)
    loss.backward()
    assert float(loss) == 0.0 and head.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_eagle3_loss_adds_the_weighted_copy_term(weight):
    from eyas.recipe import TrainSection
    from eyas.train.algorithms import eagle3_loss
    from eyas.train.losses import TargetLabels

    torch.manual_seed(0)
    head = Eagle3Head(_cfg())
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen), b=2, t=24)
    b, t = batch["input_ids"].shape
    logits = torch.randn(b, t, 64)
    labels = TargetLabels(logits=logits, argmax=logits.argmax(-1), valid=torch.ones(b, t, dtype=torch.bool))
    base = eagle3_loss(head, batch, labels, TrainSection(ttt_steps=2, compile_loss="off")).loss
    got = eagle3_loss(head, batch, labels, TrainSection(ttt_steps=2, compile_loss="off",
                                                        copy_attention_weight=weight)).loss
    targets = copy_attention_targets(batch["input_ids"], labels.valid, batch["attention_mask"])
    expected = base + weight * copy_attention_loss(head, batch, targets)
    assert torch.allclose(got, expected)
    assert (weight == 0) == bool(torch.allclose(got, base))
