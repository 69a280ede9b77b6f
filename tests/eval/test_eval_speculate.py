"""Offline speculative decoding: lossless greedy and sampled decoding, acceptance that
can fail both ways (a head that copies the target vs a random head), and agreement with
the trainer's teacher-forced accuracy."""

import math

import numpy as np
import pytest
import torch

from eyas.eval.ngram import NgramDrafter
from eyas.eval.speculate import HeadDrafter, greedy_decode, rejection_sample, speculative_decode
from eyas.eval.trace_summary import summarize
from eyas.heads.algorithms import build_head
from eyas.heads.config import head_config_from_target
from eyas.target.features import compute_features, target_norm_and_lm_head
from eyas.target.load import load_target

H, CONST = 64, 16  # the tiny targets' hidden size; embedding coords 0..15 are constant


def random_head(model, algorithm="eagle3", seed=0, draft_vocab=200, aux=(1, 4, 7)):
    torch.manual_seed(seed)
    cfg = head_config_from_target(
        model.config,
        aux_layer_ids=list(aux),
        draft_vocab_size=draft_vocab,
        algorithm=algorithm,
        mask_token_id=3 if algorithm == "peagle" else None,
    )
    head = build_head(cfg)
    vt = model.config.vocab_size
    if draft_vocab < vt:
        ids = torch.sort(torch.randperm(vt)[:draft_vocab]).values
        t2d = torch.zeros(vt, dtype=torch.bool)
        t2d[ids] = True
        head.set_vocab_map(ids - torch.arange(draft_vocab), t2d)
    emb = model.get_input_embeddings().weight
    head.init_from_target(emb, model.get_output_embeddings().weight, None)
    return head.eval()


@torch.no_grad()
def bigram_target(tiny_llama_dir, beta=1.0, seed=0):
    """A tiny Llama whose layers add nothing (o_proj, down_proj = 0), so its next-token
    distribution depends on the current token only: p(. | x) = softmax(beta * W n(e_x)),
    with lm_head row v = e_{perm^-1(v)}: the greedy successor of x is perm(x). All
    embedding rows have equal norm and share a constant block (coords 0..15)."""
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    model = target.model
    g = torch.Generator().manual_seed(seed)
    vt = model.config.vocab_size
    u = torch.randn(vt, H - CONST, generator=g)
    emb = torch.cat([torch.ones(vt, CONST), 4.0 * u / u.norm(dim=1, keepdim=True)], dim=1)
    perm = torch.randperm(vt, generator=g)
    model.get_input_embeddings().weight.copy_(emb)
    lm = torch.empty_like(emb)
    lm[perm] = emb  # row perm[x] = e_x
    model.get_output_embeddings().weight.copy_(beta * lm)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    return target, perm


@torch.no_grad()
def copy_head(model, algorithm="eagle3", aux=(1, 4, 7), lm_scale=1.0):
    """A head that computes the target's own next-token logits from the token it is fed.

    Attention reads only the constant embedding block for queries and keys (scaled up,
    rotary theta small), so every query attends to itself alone; values are the normed
    embedding, o_proj the identity, the MLP and the hidden path are zeroed
    (hidden_norm = 0 with norm_before_residual). So hidden_out = n(e_x) for the fed token
    x and logits = lm_head(norm(n(e_x))) = the target's logits after x: the head predicts
    exactly what the target will (EAGLE-3 chain: every position; P-EAGLE: the first)."""
    cfg = head_config_from_target(
        model.config,
        aux_layer_ids=list(aux),
        draft_vocab_size=model.config.vocab_size,
        algorithm=algorithm,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        norm_before_residual=True,
        mask_token_id=3 if algorithm == "peagle" else None,
    ).model_copy(update={"rope_theta": 10.0})
    head = build_head(cfg)
    for p in head.parameters():
        p.zero_()
    head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    layer = head.layers[0]
    layer.input_layernorm.weight.fill_(1.0)
    layer.post_attention_layernorm.weight.fill_(1.0)
    attn = layer.self_attn
    for h in range(4):
        for i in range(16):
            attn.q_proj.weight[16 * h + i, i] = 50.0
            attn.k_proj.weight[16 * h + i, i] = 1.0
    attn.v_proj.weight[:, :H].copy_(torch.eye(H))
    attn.o_proj.weight.copy_(torch.eye(H))
    head.norm.weight.fill_(1.0)
    head.lm_head.weight.copy_(lm_scale * model.get_output_embeddings().weight)
    return head.eval()


def _prompts(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 300, (length,), generator=g).tolist() for _ in range(n)]


# --- lossless greedy --------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_greedy_speculative_equals_plain_greedy_random_heads(tiny_target_dir, algorithm):
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    model = target.model
    for seed in range(2):
        head = random_head(model, algorithm, seed=seed)
        for prompt in _prompts(1, length=30, seed=seed):
            ref = greedy_decode(model, prompt, 24, {2})
            spec = speculative_decode(model, prompt, HeadDrafter(head), 4, 24, {2})
            assert spec.tokens == ref.tokens


def test_greedy_lossless_with_acceptances_and_sliding_window(tiny_target_dir):
    """Prompt lookup on a repetitive prompt gets drafts accepted and rejected well past
    the GPT-OSS sliding window (16), so cache rollback is exercised on every family."""
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    prompt = (list(range(40, 52)) * 5)[:56]
    ref = greedy_decode(target.model, prompt, 32, set())
    spec = speculative_decode(target.model, prompt, NgramDrafter(1, 4), 5, 32, set())
    assert spec.tokens == ref.tokens
    assert spec.forwards <= ref.forwards


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_copy_head_is_accepted_and_random_head_is_not(tiny_llama_dir, algorithm):
    target, _ = bigram_target(tiny_llama_dir)
    model = target.model
    k, traces = 5, {"copy": [], "random": []}
    heads = {"copy": copy_head(model, algorithm), "random": random_head(model, algorithm, draft_vocab=320)}
    for prompt in _prompts(3):
        ref = greedy_decode(model, prompt, 60, set())
        for name, head in heads.items():
            tr = speculative_decode(model, prompt, HeadDrafter(head), k, 60, set())
            assert tr.tokens == ref.tokens
            traces[name].append(tr)
    copy, rand = summarize(traces["copy"], k), summarize(traces["random"], k)
    assert rand["tar"] < 0.05 and rand["per_position_acceptance"][0] < 0.05
    assert copy["per_position_acceptance"][0] > 0.97
    if algorithm == "eagle3":  # the chain sees each drafted token: every position is right
        assert all(a > 0.97 for a in copy["per_position_acceptance"])
        assert copy["tau"] > k + 0.8
    else:  # one pass: mask slots cannot know the tokens before them
        assert copy["tau"] < 2.5


# --- sampled mode -----------------------------------------------------------------------


def _tv(a, b):
    return 0.5 * float((a - b).abs().sum())


def test_rejection_sample_reproduces_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    v, k, n = 12, 3, 20000
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 2, -1)
    first, counts_accept = torch.zeros(v), 0
    for _ in range(n):
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        acc, nxt = rejection_sample(p, q, draft, g)
        tok = int(draft[0]) if acc >= 1 else nxt
        first[tok] += 1
        counts_accept += acc >= 1
    freq = first / n
    noise = 3 * math.sqrt(v / n)  # ~3 sigma of the TV of n samples over v outcomes
    assert _tv(freq, p[0]) < noise / 2
    assert _tv(q[0], p[0]) > 2 * noise  # a sampler that keeps the draft would fail
    assert abs(counts_accept / n - float(torch.minimum(p[0], q[0]).sum())) < 0.02


@pytest.mark.slow  # 600 sampled generations; the rejection rule itself is tested fast above
def test_sampled_speculative_decoding_matches_the_target_chain(tiny_llama_dir):
    """The bigram target makes generation a Markov chain, so the exact marginal of every
    generated token is known. A copy head with a flatter distribution (q != p, restricted
    to a 200-token draft vocabulary) drafts; the empirical marginals of tokens 2..4 (from
    verification: accepted drafts, residual resamples, bonus tokens) must match."""
    target, _ = bigram_target(tiny_llama_dir, beta=0.35)
    model = target.model
    head = copy_head(model, "eagle3", lm_scale=0.5)
    temperature, runs, length = 1.0, 600, 4
    prompt = _prompts(1, length=12, seed=3)[0]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        norm, lm = target_norm_and_lm_head(model)
        trans = torch.softmax(lm(norm(emb)).float() / temperature, -1)  # [V, V]: p(next | current)
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float() / temperature, -1)
    exact = [first]
    for _ in range(length - 1):
        exact.append(exact[-1] @ trans)
    counts = torch.zeros(length, trans.shape[0])
    g = torch.Generator().manual_seed(1)
    traces = []
    for _ in range(runs):
        tr = speculative_decode(model, prompt, HeadDrafter(head), 3, length, set(), temperature, g)
        traces.append(tr)
        for pos, tok in enumerate(tr.tokens):
            counts[pos, tok] += 1
    for pos in range(1, length):
        freq = counts[pos] / runs
        support = int((exact[pos] > 1e-3).sum())
        assert _tv(freq, exact[pos]) < 1.5 * math.sqrt(support / runs), pos
    summary = summarize(traces, 3)
    assert 0.1 < summary["tar"] < 0.9  # drafts were both accepted and rejected
    assert summary["expected_acceptance"][0] == pytest.approx(summary["per_position_acceptance"][0], abs=0.08)


# --- agreement with the trainer ---------------------------------------------------------


def test_eval_acceptance_agrees_with_teacher_forced_accuracy(tiny_llama_dir):
    from eyas.train.losses import target_labels
    from eyas.train.reference import ttt_unroll

    target, perm = bigram_target(tiny_llama_dir)
    model = target.model
    head = copy_head(model, "eagle3", aux=(1, 4, 7))
    broken = torch.randperm(320, generator=torch.Generator().manual_seed(5))[:96]
    with torch.no_grad():
        head.lm_head.weight[broken] = 0.0  # the head never predicts these tokens
    k, new = 4, 80
    traces, seqs = [], []
    for prompt in _prompts(8, length=16, seed=7):
        tr = speculative_decode(model, prompt, HeadDrafter(head), k, new, set())
        traces.append(tr)
        seqs.append((prompt, tr.tokens))
    summary = summarize(traces, k)
    measured, reached = summary["per_position_acceptance"], summary["reached_per_position"]
    hits, counts = np.zeros(k), np.zeros(k)
    for prompt, gen in seqs:
        ids = torch.tensor([prompt + gen])
        mask = torch.ones_like(ids)
        loss_mask = torch.tensor([[0] * len(prompt) + [1] * len(gen)])
        aux, last = compute_features(model, ids, mask, list(head.config.aux_layer_ids))
        norm, lm = target_norm_and_lm_head(model)
        labels = target_labels(last, norm, lm.weight, head.draft_token_ids(), None, loss_mask, mask)
        with torch.no_grad():
            for step, logits in ttt_unroll(head, ids, mask, aux, k):
                lab = labels.shifted(1 + step)
                hits[step] += int(((logits.argmax(-1) == lab.argmax) & lab.valid).sum())
                counts[step] += int(lab.valid.sum())
    predicted = hits / counts
    assert 0.4 < predicted[0] < 0.9  # a partly right head: the comparison means something
    assert abs(measured[0] - predicted[0]) < 0.05, (measured, predicted.tolist())
    for a, b, n in zip(measured, predicted, reached):  # later positions: within 3 binomial sigmas
        assert abs(a - b) < max(0.05, 3 * math.sqrt(b * (1 - b) / n)), (measured, predicted.tolist(), reached)


def test_accepted_draft_eos_stops_like_plain_greedy(tiny_llama_dir):
    """A drafter that proposes the target's own greedy continuation gets its EOS accepted
    as a draft token (not as the bonus): decoding must stop there, as plain greedy does."""
    import torch

    from eyas.eval.speculate import greedy_decode, speculative_decode
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    prompt = [5, 6, 7, 8]
    plain = greedy_decode(target.model, prompt, 24, eos_ids=set()).tokens
    # a token first seen at a draft slot: with full acceptance and k=3 each step commits
    # plain[4j+1 .. 4j+4], the last of which is the bonus
    stop = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i] and i % 4 != 0)
    eos = {plain[stop]}
    expected = greedy_decode(target.model, prompt, 24, eos_ids=eos).tokens

    class Oracle:
        aux_layer_ids = ()

        def start(self, prompt, first, aux=None):
            self.pos = 1

        def propose(self, k, temperature=0.0, generator=None):
            return torch.tensor(plain[self.pos : self.pos + k]), None

        def commit(self, new, aux=None):
            self.pos += len(new)

    out = speculative_decode(target.model, prompt, Oracle(), 3, 24, eos_ids=eos).tokens
    assert out == expected == plain[: stop + 1]


@pytest.mark.parametrize("eos_at", [None, 9])
def test_ngram_replay_gives_the_decoded_trace(tiny_llama_dir, eos_at):
    """Replaying prompt lookup over the plain greedy tokens gives the trace that decoding
    it against the target gives: the same drafts, acceptances and tokens, also when a
    draft runs on past the reference's EOS or past max_new_tokens (the target is asked)."""
    from eyas.eval.speculate import replay_greedy

    target, perm = bigram_target(tiny_llama_dir)
    model = target.model

    def chain(x, n):  # the target's greedy continuation of x: x, perm(x), perm(perm(x)), ...
        out = [x]
        while len(out) < n:
            out.append(int(perm[out[-1]]))
        return out

    # a prompt that already holds the greedy continuation of its own ending: prompt
    # lookup drafts it, and the target accepts
    prompts = [chain(x, 14) + [11, 12, 13] + chain(x, 3) for x in (4, 50, 120)]
    checked_steps = 0
    for prompt in prompts:
        for max_new in (17, 40):
            free = greedy_decode(model, prompt, max_new, set()).tokens
            eos = {free[eos_at]} if eos_at is not None and eos_at < len(free) else set()
            plain = greedy_decode(model, prompt, max_new, eos).tokens
            decoded = speculative_decode(model, prompt, NgramDrafter(2, 3), 5, max_new, eos)
            replayed = replay_greedy(model, prompt, plain, NgramDrafter(2, 3), 5, max_new, eos)
            assert replayed.tokens == decoded.tokens == plain
            assert replayed.drafted == decoded.drafted
            assert replayed.accepted == decoded.accepted
            assert replayed.forwards == decoded.forwards
            checked_steps += sum(1 for a in decoded.accepted if a)
    assert checked_steps > 10  # prompt lookup was accepted often enough to mean something


@torch.no_grad()
def reading_head(model, algorithm, eps=0.2):
    """The copy head with its values also reading the target's states (through `fc` and
    the hidden path, scaled by `eps`): its drafts depend on the states it is fed, and at
    eps 0.2 they are right about half the time."""
    head = copy_head(model, algorithm)
    g = torch.Generator().manual_seed(1)
    head.layers[0].hidden_norm.weight.fill_(1.0)
    head.fc.weight.copy_(torch.randn(head.fc.weight.shape, generator=g))
    head.layers[0].self_attn.v_proj.weight[:, H:].copy_(eps * torch.randn(H, H, generator=g))
    return head


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_head_replay_gives_the_decoded_trace(tiny_llama_dir, algorithm):
    """A head replayed over the plain greedy tokens (its states from one forward over them,
    its chain stopped at the first rejected draft) accepts what decoding it accepts, step
    by step: the states it is fed are those of the slots the verify forwards accepted."""
    from eyas.eval.speculate import prefill, replay_greedy

    target, _ = bigram_target(tiny_llama_dir)
    model = target.model
    head = reading_head(model, algorithm)
    decoded_traces = []
    for prompt in _prompts(3):
        for max_new in (23, 60):
            shared = prefill(model, prompt, head.config.aux_layer_ids)
            plain = greedy_decode(model, prompt, max_new, set(), shared)
            decoded = speculative_decode(model, prompt, HeadDrafter(head), 5, max_new, set(), shared=shared)
            replayed = replay_greedy(
                model, prompt, plain.tokens, HeadDrafter(head), 5, max_new, set(), shared
            )
            assert replayed.tokens == decoded.tokens == plain.tokens
            assert replayed.drafted == decoded.drafted
            assert replayed.accepted == decoded.accepted
            assert replayed.forwards == decoded.forwards
            decoded_traces.append(decoded)
    rates = summarize(decoded_traces, 5)["per_position_acceptance"]
    assert 0.3 < rates[0] < 0.8  # drafts both accepted and rejected: the comparison means something


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shared_prefill_decodes_as_its_own_prefill(tiny_target_dir, temperature):
    """eval prefills a turn once for plain decoding and every drafter (eval/speculate.py::
    Prefill): each decoding extends a copy of the prompt's cache, so decoding from the
    shared prefill, twice in a row and after another decoding, gives the trace a prefill
    of its own gives; a drafter reading other aux layers prefills again."""
    from eyas.eval.speculate import prefill

    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    model = target.model
    head = random_head(model, "eagle3", seed=1)
    prompt = (list(range(40, 52)) * 4)[:44]  # repetitive: prompt lookup gets accepted too
    shared = prefill(model, prompt, HeadDrafter(head).aux_layer_ids)

    def spec(drafter, share, seed=5):
        g = torch.Generator().manual_seed(seed) if temperature > 0 else None
        return speculative_decode(model, prompt, drafter, 4, 20, set(), temperature, g, shared=share)

    own = spec(HeadDrafter(head), None)
    ngram_own = spec(NgramDrafter(1, 4), None)
    for _ in range(2):
        got = spec(HeadDrafter(head), shared)
        assert (got.tokens, got.accepted, got.forwards) == (own.tokens, own.accepted, own.forwards)
        ngram = spec(NgramDrafter(1, 4), shared)  # no aux layers: a prefill of its own
        assert (ngram.tokens, ngram.accepted) == (ngram_own.tokens, ngram_own.accepted)
    assert temperature > 0 or sum(ngram_own.accepted) > 0  # greedy: the copies are accepted
    plain = greedy_decode(model, prompt, 20, set())
    plain_shared = greedy_decode(model, prompt, 20, set(), shared)
    assert (plain_shared.tokens, plain_shared.margins) == (plain.tokens, plain.margins)
    assert plain_shared.seconds >= shared.seconds


def test_sampled_steps_that_draft_nothing_keep_the_trace_aligned(tiny_llama_dir):
    """At temperature > 0 prompt lookup drafts nothing on many steps: each step still has its
    (empty) expected-acceptance row, so the per-context split and the summary read step i's
    row for step i (a sampled eval with the n-gram baseline once failed at its very end)."""
    from eyas.eval.context_buckets import split_by_context, summarize_by_context

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 9]
    g = torch.Generator().manual_seed(0)
    tr = speculative_decode(target.model, prompt, NgramDrafter(1, 3), 3, 24, set(), 1.0, g)
    assert 0 in tr.drafted and any(tr.drafted)  # both kinds of step happened
    assert len(tr.expected) == len(tr.drafted) == len(tr.contexts)
    assert all(len(row) == d for row, d in zip(tr.expected, tr.drafted))
    parts = split_by_context([tr], [len(prompt) + 8])
    assert sum(len(p.expected) for ps in parts.values() for p in ps) == len(tr.drafted)
    assert summarize_by_context([tr], 3, [len(prompt) + 8])
