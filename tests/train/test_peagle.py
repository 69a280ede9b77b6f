"""P-EAGLE training against serving: the logits the trainer computes for a kept (anchor p,
depth d) equal those of the one-pass drafting path started at p; segments give the
unsegmented gradients; the mask-token choice; the loss overfits one batch of a tiny target."""

import pytest
import torch
from support.tiny_heads import SMALL, double_head_and_batch, small_head_config

from eyas.heads.peagle import PEagleHead, choose_mask_token_id
from eyas.recipe import TrainSection
from eyas.train.batching import shift_left
from eyas.train.losses import TargetLabels
from eyas.train.peagle import cod_grid, compact, element_label_slots, peagle_forward, peagle_loss

V, AUX = SMALL["vocab_size"], 3 * SMALL["target_hidden_size"]
PEAGLE = dict(algorithm="peagle", mask_token_id=V - 1)


def _cfg(**kw):
    return small_head_config(**PEAGLE, **kw)


@pytest.mark.parametrize("multiple", [1, 64], ids=["unpadded", "elements-padded-to-64"])
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(num_hidden_layers=2, fc_norm=True),
        dict(num_hidden_layers=3, norm_before_fc=True),
        dict(num_hidden_layers=2, sliding_window=3),
    ],
    ids=["1-layer", "2-layer-fc_norm", "3-layer-input_norm", "2-layer-window-3"],
)
def test_train_serve_equality(opts, multiple):
    b, t, depths = 2, 11, 4
    head, batch = double_head_and_batch(0, b, t, lengths=(11, 8), **PEAGLE, **opts)
    ids, am, aux = batch["input_ids"], batch["attention_mask"], batch["aux"]
    el = compact(cod_grid(am, depths, 0.7, 0.1, torch.Generator().manual_seed(5)), t, multiple)
    assert el.real.shape[1] % multiple == 0  # padding elements see only themselves
    train = peagle_forward(head, el, ids, aux)
    nxt = shift_left(ids, 1, 0)
    checked = 0
    for i in range(b):
        cache = head.new_cache()
        for p in range(int(am[i].sum())):
            # incremental serving: one committed step-0 entry per call, K = depths drafts
            _, serve = head.draft(
                cache, nxt[i : i + 1, p : p + 1], aux[i : i + 1, p : p + 1], torch.tensor([[p]]), k=depths
            )
            assert cache.length == p + 1
            for j in (el.real[i] & (el.anchor[i] == p)).nonzero()[:, 0].tolist():
                d = int(el.depth[i, j])
                torch.testing.assert_close(train[i, j], serve[0, d], rtol=1e-10, atol=1e-10)
                checked += 1
    assert checked == int(el.real.sum()) and checked > int(am.sum())


def _random_labels(attention_mask, vd, gen):
    """Like `target_labels`: slot s counts only where token s+1 is real (and, here, at random)."""
    b, t = attention_mask.shape
    logits = torch.randn(b, t, vd, generator=gen) * 3
    valid = torch.rand(b, t, generator=gen) > 0.2
    valid[:, :-1] &= attention_mask[:, 1:].bool()
    valid[:, -1] = False
    return TargetLabels(logits=logits, argmax=logits.argmax(-1), valid=valid)


def test_segments_give_the_unsegmented_loss_and_gradients():
    head, batch = double_head_and_batch(2, 2, 17, num_hidden_layers=2, **PEAGLE)
    batch["attention_mask"][0, 13:] = 0
    labels = _random_labels(batch["attention_mask"], V, torch.Generator().manual_seed(0))
    results = []
    for seg in (None, 5):
        cfg = TrainSection(peagle={"num_depths": 4, "cod_r": 0.8, "cod_r_min": 0.2, "segment_length": seg})
        head.zero_grad()
        stats = peagle_loss(head, batch, labels, cfg, torch.Generator().manual_seed(9))
        stats.loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((stats, grads))
    (full, g_full), (seg, g_seg) = results
    torch.testing.assert_close(full.loss.detach(), seg.loss.detach(), rtol=1e-9, atol=1e-12)
    assert full.counts == seg.counts and full.hits == seg.hits and len(full.counts) == 4
    assert full.counts[0] == int(labels.valid[:, 1:].sum())  # depth 0 at anchor p learns slot p + 1
    assert g_full.keys() == g_seg.keys() and {"mask_hidden", "mask_embedding"} <= g_full.keys()
    assert "embed_tokens.weight" in g_full  # this head is wider than its target: its whole table trains
    for name in g_full:
        # RMSNorm computes in float32 even in a float64 head; a prefix element's gradient
        # arrives in pieces (one per segment), each rounded there: float32-level agreement
        torch.testing.assert_close(
            g_full[name], g_seg[name], rtol=1e-6, atol=1e-8, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(
    "seg,loss,labelled",
    [
        (None, "kl", False),
        (6, "kl", False),
        (None, "tv", False),
        (6, "tv", False),
        (None, "lk", False),
        (6, "kl", True),
    ],
)
def test_loss_equals_the_mean_loss_over_every_labelled_element(seg, loss, labelled):
    """The loss runs the LM head on the labelled elements only, in padded row and element
    counts; it must equal `train.loss` (soft cross-entropy, total variation, or their LK
    blend with one weight per depth) of the full logits of the unpadded elements, and so
    must its gradients."""
    head, batch = double_head_and_batch(5, 3, 19, num_hidden_layers=1, **PEAGLE)
    batch["attention_mask"][1, 12:] = 0
    labels = _random_labels(batch["attention_mask"], V, torch.Generator().manual_seed(2))
    cfg = TrainSection(
        loss=loss,
        lk_eta=1.5,
        peagle={
            "num_depths": 4,
            "cod_r": 0.6,
            "cod_r_min": 0.1,
            "segment_length": seg,
            "cod_labelled_only": labelled,
        },
    )
    stats = peagle_loss(head, batch, labels, cfg, torch.Generator().manual_seed(3))
    stats.loss.backward()
    fast = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    grid = cod_grid(
        batch["attention_mask"],
        4,
        0.6,
        0.1,
        torch.Generator().manual_seed(3),
        labels.valid if labelled else None,
    )
    el = compact(grid, 19)
    slot, valid = element_label_slots(el, labels)
    target = labels.logits.gather(1, slot[..., None].expand(-1, -1, V))
    logits = peagle_forward(head, el, batch["input_ids"], batch["aux"])
    probs = torch.softmax(target[valid], dim=-1)  # float64 throughout
    ce = -(probs * torch.log_softmax(logits[valid], dim=-1)).sum(-1)
    tv = 0.5 * (probs - torch.softmax(logits[valid], dim=-1)).abs().sum(-1)
    depth = el.depth[valid]
    alpha = (1 - tv).detach()
    lam = torch.stack([torch.exp(-1.5 * alpha[depth == d].mean()) for d in range(4)])[depth]
    reference = {"kl": ce, "tv": tv, "lk": lam * ce + (1 - lam) * tv}[loss].mean()
    reference.backward()
    # float32-level agreement: the head's RMSNorm computes in float32 even in a float64 head
    torch.testing.assert_close(stats.loss.detach(), reference.detach(), rtol=1e-6, atol=1e-9)
    assert sum(stats.counts) == int(valid.sum())
    assert fast.keys() == {n for n, p in head.named_parameters() if p.grad is not None}
    for name, p in head.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(
                fast[name], p.grad, rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_a_head_as_wide_as_its_target_learns_only_the_mask_row():
    b, t = 2, 9
    head, batch = double_head_and_batch(0, b, t, hidden_size=24, intermediate_size=48, **PEAGLE)
    table = head.embed_tokens.weight.detach().clone()
    labels = _random_labels(batch["attention_mask"], V, torch.Generator().manual_seed(0))
    cfg = TrainSection(peagle={"num_depths": 3, "cod_r": 0.8, "cod_r_min": 0.2})
    stats = peagle_loss(head, batch, labels, cfg, torch.Generator().manual_seed(1))
    stats.loss.backward()
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "mask_embedding" in trainable
    assert head.embed_tokens.weight.grad is None and head.mask_embedding.grad.abs().sum() > 0
    torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=0.1).step()
    assert torch.equal(head.embed_tokens.weight, table)  # the table is the target's, untouched


@pytest.mark.parametrize("seg", [None, 5])
def test_loss_weighting_counts_each_element_or_each_depth_alike(seg):
    """ "element": the loss is the mean over every labelled element, so depth 0 (all anchors)
    dominates the sparsely kept depths; "depth": the mean of the per-depth means."""
    head, batch = double_head_and_batch(3, 2, 23, num_hidden_layers=1, **PEAGLE)
    labels = _random_labels(batch["attention_mask"], V, torch.Generator().manual_seed(1))
    losses = {}
    for weighting in ("element", "depth"):
        cfg = TrainSection(
            peagle={
                "num_depths": 4,
                "cod_r": 0.5,
                "cod_r_min": 0.1,
                "segment_length": seg,
                "loss_weighting": weighting,
            }
        )
        stats = peagle_loss(head, batch, labels, cfg, torch.Generator().manual_seed(4))
        losses[weighting] = float(stats.loss)
        counts, per_depth = stats.counts, stats.step_losses
        assert counts[0] > 1.5 * counts[1] > 0 and counts[3] > 0  # COD keeps fewer deeper
    element = sum(c * x for c, x in zip(counts, per_depth)) / sum(counts)
    assert losses["element"] == pytest.approx(element, rel=1e-9)
    assert losses["depth"] == pytest.approx(sum(per_depth) / len(per_depth), rel=1e-9)
    assert abs(losses["depth"] - losses["element"]) > 1e-3  # the choice matters on this batch
    with pytest.raises(ValueError):
        TrainSection(peagle={"loss_weighting": "token"}).section("peagle")


class _Tok:
    def __init__(self, n, added, special=(), mask=None):
        self.n, self.added, self.all_special_ids, self.mask_token_id = n, added, list(special), mask

    def __len__(self):
        return self.n

    def get_added_vocab(self):
        return dict(self.added)


def test_choose_mask_token_id_order():
    full = _Tok(100, {"<s>": 0, "<|reserved_7|>": 97, "<|reserved_3|>": 93, "<x>": 5}, special=[0])
    assert choose_mask_token_id(full, 100, explicit=4) == 4
    with pytest.raises(ValueError, match="outside"):
        choose_mask_token_id(full, 100, explicit=100)
    assert choose_mask_token_id(_Tok(100, {}, mask=42), 100) == 42
    assert choose_mask_token_id(_Tok(90, {}), 100) == 90  # first embedding row past the tokenizer
    assert choose_mask_token_id(full, 100) == 93
    no_reserved = _Tok(100, {"<s>": 0, "<a>": 5, "<b>": 6}, special=[0])
    assert choose_mask_token_id(no_reserved, 100) == 6
    freqs = torch.ones(100)
    freqs[6] = 10
    assert choose_mask_token_id(no_reserved, 100, token_freqs=freqs) == 5
    freqs = torch.ones(100)
    freqs[17] = 0
    assert choose_mask_token_id(_Tok(100, {"<s>": 0}, special=[0]), 100, token_freqs=freqs) == 17
    with pytest.raises(ValueError, match="mask_token_id"):
        choose_mask_token_id(_Tok(100, {"<s>": 0}, special=[0]), 100)


def test_choose_mask_token_id_on_the_tiny_tokenizer(tiny_tokenizer):
    assert choose_mask_token_id(tiny_tokenizer, 320) == len(tiny_tokenizer)


def test_peagle_loss_overfits_one_batch_of_a_tiny_target(tiny_llama_dir):
    from eyas.heads.config import head_config_from_target
    from eyas.target.features import compute_features, default_aux_layer_ids, target_norm_and_lm_head
    from eyas.target.load import load_target, text_config
    from eyas.train.losses import target_labels

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    tcfg = text_config(target.config)
    aux_ids = list(default_aux_layer_ids(tcfg.num_hidden_layers))
    mask_id = choose_mask_token_id(target.tokenizer, tcfg.vocab_size)
    cfg = head_config_from_target(
        tcfg,
        aux_layer_ids=aux_ids,
        draft_vocab_size=tcfg.vocab_size,
        algorithm="peagle",
        num_hidden_layers=2,
        mask_token_id=mask_id,
    )
    torch.manual_seed(0)
    head = PEagleHead(cfg)
    norm, lm_head = target_norm_and_lm_head(target.model)
    head.init_from_target(target.model.get_input_embeddings().weight, lm_head.weight, norm.weight)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 260, (2, 40), generator=gen)
    am = torch.ones_like(ids)
    aux, last = compute_features(target.model, ids, am, aux_ids)
    labels = target_labels(last, norm, lm_head.weight, head.draft_token_ids(), None, am, am)
    # The tiny random target is nearly flat (top probability ~1.5%); a sharper copy
    # (temperature 1/4) gives its argmax a margin a few hundred steps can learn.
    labels.logits *= 4
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": am, "aux": aux, "last": last}
    train_cfg = TrainSection(peagle={"num_depths": 3, "cod_r": 0.8, "cod_r_min": 0.2})
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small only lose time to threading
    try:
        for _ in range(250):
            stats = peagle_loss(head, batch, labels, train_cfg, gen)
            opt.zero_grad()
            stats.loss.backward()
            opt.step()
        # every element this time (r = r_min = 1)
        with torch.no_grad():
            stats = peagle_loss(
                head,
                batch,
                labels,
                TrainSection(peagle={"num_depths": 3, "cod_r": 1.0, "cod_r_min": 1.0}),
                gen,
            )
    finally:
        torch.set_num_threads(threads)
    acc = [h / c for h, c in zip(stats.hits, stats.counts)]
    # (p, d) learns slot p+d+1, valid for p+d+1 <= 38 (token 39 is the last): 38 - d per row
    assert stats.counts == [2 * (38 - d) for d in range(3)]
    assert acc[0] > 0.9, acc
    assert acc[1] > 0.3, acc  # chance is ~1/320


@pytest.mark.slow
def _dense_and_flex_logits(head, elements, ids, aux):
    """The head's logits over `elements` under SDPA with the dense mask, and under flex
    attention with the block mask (the CUDA path, forward only here)."""
    from eyas.train.masks import peagle_block_mask, peagle_dense_mask
    from eyas.train.peagle import element_inputs

    el = elements
    with torch.no_grad():
        tokens, hidden = element_inputs(head, el, ids, aux)
        return [
            head.forward_step(
                tokens, hidden, el.positions, head.new_cache(), mask(el.anchor, el.depth, el.real)
            )[0]
            for mask in (peagle_dense_mask, peagle_block_mask)
        ]


@pytest.mark.parametrize("b", [2, 3], ids=["2-rows", "3-rows-padded-to-4"])
def test_flex_block_mask_gives_the_dense_mask_logits(b):
    """The CUDA path (flex attention over the block mask, its rows and elements padded to
    `flex_bucket`s) against SDPA with the dense mask; run here on CPU, forward only (flex
    has no CPU backward)."""

    torch.manual_seed(0)
    head = PEagleHead(_cfg(num_hidden_layers=2))
    t = 40
    ids = torch.randint(0, V - 1, (b, t))
    am = torch.ones(b, t, dtype=torch.long)
    am[1, 30:] = 0
    el = compact(cod_grid(am, 4, 0.7, 0.1, torch.Generator().manual_seed(1)), t)
    dense, flex = _dense_and_flex_logits(head, el, ids, torch.randn(b, t, AUX))
    torch.testing.assert_close(flex[el.real], dense[el.real], rtol=1e-5, atol=1e-5)


def test_flex_attention_falls_back_to_torch_tiles_once_refused(monkeypatch, caplog):
    """A torch whose flex attention rejects eyas's tile sizes gets its own choice, with one
    warning, and is not asked again; CPU tensors never get tile sizes."""
    from eyas.heads import flex_attention as layers

    calls = []

    def fake_flex(q, k, v, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
        calls.append(kernel_options)
        if kernel_options:
            raise RuntimeError("tiles not supported")
        return q * scale

    assert layers.flex_kernel_options(torch.zeros(1, 1, 4, 64)) is None
    monkeypatch.setattr(layers, "_compiled_flex_attention", lambda: fake_flex)
    monkeypatch.setattr(layers, "flex_kernel_options", lambda q: {"BLOCK_M": 128})
    monkeypatch.setattr(layers, "_flex_options_failed", [])
    q = torch.randn(1, 1, 4, 8)
    with caplog.at_level("WARNING"):
        out = layers.flex_block_attention(q, q, q, None, 2.0, False)
        layers.flex_block_attention(q, q, q, None, 2.0, False)
    torch.testing.assert_close(out, q * 2.0)
    assert calls == [{"BLOCK_M": 128}, None, None]
    assert caplog.text.count("refused kernel options") == 1


def test_flex_bucket_rounds_rows_and_elements_to_powers_of_two():
    from eyas.heads.flex_attention import FLEX_MIN_LENGTH, flex_bucket

    assert [flex_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]
    assert [flex_bucket(n, FLEX_MIN_LENGTH) for n in (1, 100, 128, 129, 4000)] == [128, 128, 128, 256, 4096]


def test_peagle_batches_reach_flex_attention_in_few_shapes(monkeypatch):
    """Compiled flex attention is specialised per shape and runs eagerly (every score
    materialised) past dynamo's recompile limit: batches of every length must reach it in
    a handful of shapes, each a power of two, with the real rows' output unchanged."""
    from eyas.heads import flex_attention as layers

    shapes = set()

    def recording_flex(q, k, v, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
        shapes.add((tuple(q.shape), tuple(k.shape), tuple(block_mask.shape)))
        rows, _, q_len, kv_len = block_mask.shape
        dense = block_mask.mask_mod(
            torch.arange(rows)[:, None, None, None],
            torch.zeros(1, 1, 1, 1, dtype=torch.long),
            torch.arange(q_len)[None, None, :, None],
            torch.arange(kv_len)[None, None, None, :],
        )
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, scale=scale, enable_gqa=enable_gqa
        )

    monkeypatch.setattr(layers, "_compiled_flex_attention", lambda: recording_flex)
    torch.manual_seed(0)
    head = PEagleHead(_cfg())
    lengths = [(b, t) for b in (1, 2, 3, 5) for t in (9, 17, 30, 41)]  # at most 128 elements
    for i, (b, t) in enumerate(lengths):
        ids = torch.randint(0, V - 1, (b, t))
        am = torch.ones(b, t, dtype=torch.long)
        am[0, t - 3 :] = 0
        el = compact(cod_grid(am, 4, 0.7, 0.1, torch.Generator().manual_seed(i)), t)
        dense, flex = _dense_and_flex_logits(head, el, ids, torch.randn(b, t, AUX))
        torch.testing.assert_close(flex[el.real], dense[el.real], rtol=1e-5, atol=1e-5)
    q_shapes = {q for q, _, _ in shapes}
    assert len(q_shapes) <= 4 < len(lengths)  # rows 1, 2, 4, 8 at 128 elements each
    for q, k, mask in shapes:
        assert q[0] & (q[0] - 1) == 0 and q[2] & (q[2] - 1) == 0 and q[2] >= 128
        assert (mask[0], mask[2], mask[3]) == (q[0], q[2], k[2])


def test_labelled_only_cod_drops_only_elements_without_loss():
    """Drawing every element (r = r_min = 1), `cod_labelled_only` leaves out exactly the
    deeper elements of chains with no label, and the loss, its gradients and the per-depth
    counts are those of the full draw: what it drops carried no loss. At r < 1 every
    deeper element it keeps is on a labelled chain."""
    from eyas.train.peagle import labelled_chains

    head, batch = double_head_and_batch(7, 2, 15, num_hidden_layers=2, **PEAGLE)
    batch["attention_mask"][1, 11:] = 0
    labels = _random_labels(batch["attention_mask"], V, torch.Generator().manual_seed(4))
    labels.valid[:, :5] = False  # a prompt: no labels on its first slots
    am, d = batch["attention_mask"], 4
    every = cod_grid(am, d, 1.0, 1.0, torch.Generator().manual_seed(1))
    labelled = cod_grid(am, d, 1.0, 1.0, torch.Generator().manual_seed(1), labels.valid)
    useful = labelled_chains(labels.valid, d).reshape(2, d * 15)
    useful[:, :15] = True  # depth 0 is always kept
    assert torch.equal(labelled, every & useful) and int(labelled.sum()) < int(every.sum())
    results = []
    for on in (False, True):
        cfg = TrainSection(peagle={"num_depths": d, "cod_r": 1.0, "cod_r_min": 1.0, "cod_labelled_only": on})
        head.zero_grad()
        stats = peagle_loss(head, batch, labels, cfg, torch.Generator().manual_seed(1))
        stats.loss.backward()
        results.append((stats, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (full, g_full), (mine, g_mine) = results
    torch.testing.assert_close(mine.loss.detach(), full.loss.detach(), rtol=1e-6, atol=1e-9)
    assert mine.counts == full.counts and mine.hits == full.hits
    for name in g_full:
        torch.testing.assert_close(g_mine[name], g_full[name], rtol=1e-6, atol=1e-8)

    sparse = cod_grid(am, d, 0.5, 0.1, torch.Generator().manual_seed(2), labels.valid)
    assert bool(sparse[:, 15:][~useful[:, 15:]].logical_not().all())
    assert int(sparse[:, 15:].sum()) > 0
