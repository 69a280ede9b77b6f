"""Copy supervision of the EAGLE-3 head's attention (train/copy_attention.py)."""

import pytest
import torch
from support.tiny_heads import small_head_config

import eyas.train.copy_attention as copy_attention
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.layers import TTTMask
from eyas.train.copy_attention import copy_attention_loss, copy_attention_targets, recording_head0
from eyas.train.reference import ttt_unroll


def _ones(ids):
    return torch.ones_like(ids, dtype=torch.bool)


def test_target_is_the_slot_whose_token_comes_next():
    # slot t reads x_{t+1}; its label is x_{t+2}
    ids = torch.tensor([[5, 1, 2, 3, 4, 9, 1, 2, 3, 4, 7]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids))[0, 0].tolist()
    # slot 6 reads "2" after "1" and must predict 3: slot 2 reads "3" (x_3) and holds x_2 = 2
    assert got[6] == 2 and got[7] == 3
    # slot 8 reads "4" (after "3"); "4" was followed by 9 before, the label is 7: no source
    assert got[8] == -1
    # nothing before the repeat starts
    assert all(g == -1 for g in got[:6])


def test_target_needs_the_previous_token_to_match_too():
    # "2" recurs with a different token before it: one shared token is not a copy
    ids = torch.tensor([[1, 2, 3, 8, 2, 3, 5]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids))[0, 0].tolist()
    assert got == [-1] * 7
    assert copy_attention_targets(ids, _ones(ids), _ones(ids), min_match=1)[0, 0, 3] == 1


def test_latest_source_wins_and_labels_gate_queries():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids))[0, 0].tolist()
    assert got[6] == 4  # reads "2" after "1", label 3: slots 1 and 4 qualify, 4 is later
    valid = _ones(ids)
    valid[0, 7] = False  # slot 6's label is slot 7's
    assert copy_attention_targets(ids, valid, _ones(ids))[0, 0, 6] == -1


def test_padding_is_never_a_source_or_a_query():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    am = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    got = copy_attention_targets(ids, am.bool(), am)[0]
    assert got[0, 3] == 1 and (got[0, 4:] == -1).all()
    # a run of one token: the source is the query slot itself (its own key is visible)
    assert got[1, 1:6].tolist() == [1, 2, 3, 4, 5]


def _cfg():
    return small_head_config(vocab_size=64, draft_vocab_size=64, fc_norm=True)


def _copy_batch(gen, table, b=8, t=48):
    """Random tokens that repeat with a per-sample period; aux_s encodes x_s."""
    ids = torch.randint(4, 64, (b, t), generator=gen)
    for i in range(b):
        p = int(torch.randint(3, t // 2, (), generator=gen))
        for j in range(p, t):
            ids[i, j] = ids[i, j - p]
    aux = table[ids] + 0.1 * torch.randn(b, t, table.shape[1], generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "aux": aux}


def _copy_loss(head, batch, steps=1, decay=1.0):
    """Run the TTT unroll over `batch` while recording head 0; the copy loss of its steps."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    with recording_head0(head) as records:
        for _ in ttt_unroll(head, ids, am, batch["aux"], steps):
            pass
    targets = copy_attention_targets(ids, _ones(ids), am, steps=steps)
    return copy_attention_loss(records, targets, decay), targets, records


def _source_probability(head, batch):
    """Head 0's attention probability on the copy source (geometric mean over queries)."""
    with torch.no_grad():
        loss, targets, _ = _copy_loss(head, batch)
    assert (targets >= 0).sum() > 50
    return float(torch.exp(-loss))


def test_supervision_teaches_head_zero_to_find_the_copy_source():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    head = Eagle3Head(_cfg())
    table = torch.randn(64, 3 * 24, generator=gen)
    held_out = _copy_batch(torch.Generator().manual_seed(1), table)
    before = _source_probability(head, held_out)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        loss = _copy_loss(head, _copy_batch(gen, table))[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _source_probability(head, held_out)
    assert before < 0.1 and after > 0.4, (before, after)


def test_loss_reaches_only_what_head_zero_reads():
    head = Eagle3Head(_cfg())
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen))
    _copy_loss(head, batch)[0].backward()
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
    loss, targets, _ = _copy_loss(head, batch, steps=2)
    assert (targets == -1).all()
    loss.backward()
    assert float(loss.detach()) == 0.0 and head.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_eagle3_loss_adds_the_weighted_copy_term(weight):
    from eyas.recipe import TrainSection
    from eyas.train.eagle3 import eagle3_loss
    from eyas.train.losses import TargetLabels

    torch.manual_seed(0)
    head = Eagle3Head(_cfg())
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen), b=2, t=24)
    b, t = batch["input_ids"].shape
    logits = torch.randn(b, t, 64)
    labels = TargetLabels(logits=logits, argmax=logits.argmax(-1), valid=torch.ones(b, t, dtype=torch.bool))
    base = eagle3_loss(head, batch, labels, TrainSection(compile_loss="off", eagle3={"ttt_steps": 2})).loss
    got = eagle3_loss(
        head,
        batch,
        labels,
        TrainSection(
            compile_loss="off",
            eagle3={"ttt_steps": 2, "copy_attention_steps": 2, "copy_attention_weight": weight},
        ),
    ).loss
    expected = base + weight * _copy_loss(head, batch, steps=2, decay=0.8)[0]
    assert torch.allclose(got, expected)
    assert (weight == 0) == bool(torch.allclose(got, base))


def test_deeper_steps_read_only_sources_their_query_can_see():
    # step k at slot t reads x_{t+1+k}, predicts x_{t+2+k} and sees step-0 slots j <= t
    ids = torch.tensor([[1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 5, 8]])
    got = copy_attention_targets(ids, _ones(ids), _ones(ids), steps=3)
    # the repeat "1 2 3 4 5" from slot 7: step 0 at slot 7 reads "2" after "1", label 3
    assert got[0, 0, 7] == 1
    # steps 1 and 2 at slot 7 read "3" and "4" further on: their sources move with them
    assert got[1, 0, 7] == 2 and got[2, 0, 7] == 3
    # step 1 at slot 6 asks what step 0 at slot 7 asks
    assert got[1, 0, 6] == got[0, 0, 7]
    # but a source after the query's own slot is invisible to it
    ids2 = torch.tensor([[7, 9, 9, 9, 9, 9]])
    got2 = copy_attention_targets(ids2, _ones(ids2), _ones(ids2), steps=2)
    assert got2[0, 0, 2] == 2 and got2[1, 0, 2] == 2
    assert got2[1, 0, 1] == -1  # asks what step 0 at slot 2 asks, but slot 2 > 1


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("step", [0, 1, 2])
def test_loss_scores_are_the_attention_the_ttt_step_computes(step, window):
    """exp(-CE) of one query is head 0's real attention probability on its source, under
    the TTT mask (step-0 keys <= t, within the window, then the step's own diagonal keys)."""
    torch.manual_seed(0)
    head = Eagle3Head(_cfg().model_copy(update={"sliding_window": window}))
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen), b=2, t=20)
    ids, am = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        with recording_head0(head) as records:
            for _ in ttt_unroll(head, ids, am, batch["aux"], step + 1):
                pass
    targets = copy_attention_targets(ids, _ones(ids), am, steps=step + 1, window=window)
    b, t = (targets[step] >= 0).nonzero()[-1].tolist()  # the last: a window hides keys from it
    only = torch.full_like(targets, -1)
    only[step, b, t] = targets[step, b, t]
    got = float(torch.exp(-copy_attention_loss(records, only, window=window)))
    ttt = TTTMask(am, window=window)
    lo = ttt.start(step, t, t + 1)
    assert lo == (0 if window is None else t + step - window + 1)
    chain = [records[i][1][b, t : t + 1] for i in range(1, step + 1)]
    keys = torch.cat([records[0][1][b, lo : t + 1], *chain])
    mask = ttt.for_block(step, t, t + 1)
    allowed = mask[min(b, mask.shape[0] - 1), 0, 0]
    scores = (records[step][0][b, t] @ keys.T) / 8**0.5
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)[targets[step, b, t] - lo]
    assert got == pytest.approx(float(want), rel=1e-5)


def _reference_targets(ids, valid, am, steps, min_match, window):
    """copy_attention_targets from its definition, slot by slot."""
    x = [[int(v) if a else -1 for v, a in zip(row, mrow)] for row, mrow in zip(ids.tolist(), am.tolist())]
    b, t = ids.shape
    out = torch.full((steps, b, t), -1, dtype=torch.long)
    for r in range(b):
        for k in range(steps):
            for s in range(t):
                q = s + k  # step k at slot s asks what step 0 at slot q asks
                if q + 2 >= t or x[r][q + 2] < 0 or not valid[r, q + 1]:
                    continue
                for j in range(s, -1, -1):
                    if window is not None and j <= q - window:
                        break
                    same = all(
                        j - i >= 0 and q + 1 - i >= 0 and x[r][j - i] == x[r][q + 1 - i]
                        for i in range(min_match)
                    )
                    if same and x[r][j + 1] == x[r][q + 2]:
                        out[k, r, s] = j
                        break
    return out


@pytest.mark.parametrize("window", [None, 4, 9])
def test_blocked_targets_are_the_definitions(monkeypatch, window):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4, (3, 40), generator=gen)  # four tokens: sources everywhere
    am = torch.ones_like(ids)
    am[1, 31:] = 0
    valid = torch.rand(3, 40, generator=gen) > 0.2
    want = _reference_targets(ids, valid, am, 3, 2, window)
    assert (want >= 0).sum() > 5  # sources to find, at every window
    for block in (3, 7, 512):  # queries in blocks of 3 and 7, and all at once
        monkeypatch.setattr(copy_attention, "COPY_QUERY_BLOCK", block)
        assert torch.equal(copy_attention_targets(ids, valid, am, steps=3, window=window), want)


def test_a_window_drops_the_sources_it_hides():
    # slot 12 reads "2" after "1" and predicts 3: the source, slot 1 (x_0 x_1 x_2 = 1 2 3),
    # is 11 positions back
    ids = torch.tensor([[1, 2, 3, 9, 8, 7, 6, 5, 4, 0, 0, 1, 1, 2, 3]])
    assert copy_attention_targets(ids, _ones(ids), _ones(ids))[0, 0, 12] == 1
    assert copy_attention_targets(ids, _ones(ids), _ones(ids), window=12)[0, 0, 12] == 1
    assert copy_attention_targets(ids, _ones(ids), _ones(ids), window=11)[0, 0, 12] == -1
    # step 1 at slot 11 asks the same from position 12: the same bound
    assert copy_attention_targets(ids, _ones(ids), _ones(ids), steps=2, window=12)[1, 0, 11] == 1
    assert copy_attention_targets(ids, _ones(ids), _ones(ids), steps=2, window=11)[1, 0, 11] == -1


@pytest.mark.parametrize("window", [None, 12])
def test_blocked_loss_and_gradients_are_the_whole_ones(monkeypatch, window):
    """Query blocks and recomputation for backward change no loss and no gradient."""
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen), b=2, t=40)
    ids, am = batch["input_ids"], batch["attention_mask"]
    head = Eagle3Head(_cfg().model_copy(update={"sliding_window": window})).double()
    batch["aux"] = batch["aux"].double()
    targets = copy_attention_targets(ids, _ones(ids), am, steps=2, window=window)
    assert (targets >= 0).sum() > 10
    got = []
    for block in (4, 512):
        monkeypatch.setattr(copy_attention, "COPY_QUERY_BLOCK", block)
        head.zero_grad()
        with recording_head0(head) as records:
            for _ in ttt_unroll(head, ids, am, batch["aux"], 2):
                pass
        loss = copy_attention_loss(records, targets, 0.8, window=window)
        loss.backward()
        got.append((loss.detach(), head.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert torch.allclose(got[0][0], got[1][0], rtol=1e-12)
    assert torch.allclose(got[0][1], got[1][1], rtol=1e-10)


def test_deeper_step_supervision_reaches_the_chain_that_feeds_it():
    head = Eagle3Head(_cfg())
    gen = torch.Generator().manual_seed(0)
    batch = _copy_batch(gen, torch.randn(64, 72, generator=gen))
    _copy_loss(head, batch, steps=2)[0].backward()
    # step 1's query is computed from step 0's output: v/o/MLP of layer 0 now get a gradient
    assert head.layers[0].self_attn.v_proj.weight.grad.abs().sum() > 0
    assert head.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    assert head.layers[0].self_attn.head0_probe is None  # the recording is switched off again
