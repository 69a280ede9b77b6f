"""Speculative decoding against the real target, one sequence at a time (DESIGN §6).

Each step: the drafter proposes up to K tokens, one target forward verifies them over
K+1 positions with the target's KV cache (an HF `DynamicCache`, cropped after a
rejection), the longest accepted prefix plus the bonus token is kept. The same verify
forward yields the target's aux hidden states of the accepted slots, which become the
head's next step-0 entries. Greedy by default; with temperature > 0 the lossless
rejection rule (accept x with prob min(1, p(x)/q(x)), else resample from
norm(max(p - q, 0))), p shaped as vLLM shapes it (temperature, top-k, top-p:
`serving_probs`). The draft is sampled from q (`eval.sampler: exact`, and vLLM's
`draft_sample_method: probabilistic`) or, with `greedy_drafts`, is the drafter's argmax
with q one-hot, so accepted with probability p(x): vLLM's default (`eval.sampler: vllm`).

Drafters: `HeadDrafter` (EAGLE-3 chain / P-EAGLE one pass, via `head.draft`) and
`eyas.eval.ngram.NgramDrafter`. A drafter has `aux_layer_ids`, `start(prompt,
first_token, aux)`, `propose(k, temperature, generator) -> (ids [k'], q [k', Vt] | None)`
and `commit(new_tokens, aux)`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from eyas.core.sampling import serving_probs
from eyas.target.features import capture_aux


@dataclass
class DecodeTrace:
    """One generation. `drafted[i]` / `accepted[i]`: draft tokens proposed / accepted at
    verify step i; `expected[i]`: per draft position sum_v min(p(v), q(v)) (sampled mode)."""

    tokens: list[int]
    seconds: float
    forwards: int  # target forwards including the prefill
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    expected: list[list[float]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # plain greedy: top-1 minus top-2 logit
    # the context at verify step i: prompt + tokens generated before it (eval/context_buckets.py)
    contexts: list[int] = field(default_factory=list)


def new_target_cache(model):
    """A `DynamicCache` that can be rolled back, sliding-window layers included."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


@dataclass
class Prefill:
    """The target's forward over a prompt, shared by every decoding of that prompt: at
    8k tokens on a CPU it costs more than decoding 64 tokens after it, and it is the same
    forward for plain decoding and each drafter. `logits` [1, V] at the last prompt
    position; `aux` [T, C] the states of `aux_layer_ids` (None without); `seconds` is
    added to each decoding's time, so tok/s reads as if each had run its own."""

    cache: object
    logits: torch.Tensor
    aux: torch.Tensor | None
    aux_layer_ids: tuple[int, ...]
    seconds: float

    def fresh_cache(self):
        """A copy of the prompt's KV cache for one decoding to extend and crop."""
        return copy.deepcopy(self.cache)


@torch.no_grad()
def prefill(model, prompt: list[int], aux_layer_ids=()) -> Prefill:
    device = model.get_output_embeddings().weight.device
    cache = new_target_cache(model)
    start = time.perf_counter()
    with capture_aux(model, aux_layer_ids) as grabbed:
        out = model(
            input_ids=torch.tensor([prompt], device=device), cache=cache, use_cache=True, logits_to_keep=1
        )
    aux = grabbed.get("aux")
    return Prefill(
        cache=cache,
        logits=out.logits[0, -1:],
        aux=aux[0] if aux is not None else None,
        aux_layer_ids=tuple(aux_layer_ids),
        seconds=time.perf_counter() - start,
    )


def _start(model, prompt: list[int], aux_layer_ids, shared: Prefill | None):
    """(cache, logits [1, V], aux [T, C] | None, seconds already spent): from `shared`
    (a copy of its cache) when it holds these aux states, else from a prefill of its own."""
    if shared is not None and shared.aux_layer_ids == tuple(aux_layer_ids):
        return shared.fresh_cache(), shared.logits, shared.aux, shared.seconds
    own = prefill(model, prompt, aux_layer_ids)
    return own.cache, own.logits, own.aux, own.seconds


@torch.no_grad()
def greedy_decode(
    model, prompt: list[int], max_new_tokens: int, eos_ids: set[int], shared: Prefill | None = None
) -> DecodeTrace:
    """Plain greedy decoding with a KV cache, one token per target forward (after
    `shared`'s prefill when given: plain decoding reads no aux states)."""
    device = model.get_output_embeddings().weight.device
    # any shared prefill serves: plain decoding ignores the aux states it holds
    aux_layer_ids = shared.aux_layer_ids if shared is not None else ()
    cache, logits, _, before = _start(model, prompt, aux_layer_ids, shared)
    start = time.perf_counter() - before
    logits = logits[0]
    out, margins, forwards = [], [], 1
    while True:
        top = logits.float().topk(2)
        tok = int(top.indices[0])
        out.append(tok)
        margins.append(float(top.values[0] - top.values[1]))
        if tok in eos_ids or len(out) >= max_new_tokens:
            break
        logits = model(input_ids=torch.tensor([[tok]], device=device), cache=cache, use_cache=True).logits[
            0, -1
        ]
        forwards += 1
    return DecodeTrace(tokens=out, seconds=time.perf_counter() - start, forwards=forwards, margins=margins)


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, generator=None):
    """Lossless speculative sampling for one sequence.

    p [k+1, V] target probabilities at the k draft positions and the bonus position;
    q [k, V] draft probabilities on target ids (None: the draft was deterministic, q is
    one-hot); draft [k]. Returns (accepted count n, the token that follows them).
    """
    k = draft.shape[0]
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft]
    q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=p.device)
    ok = u * q_x < p_x  # accept with probability min(1, p/q)
    n = int(ok.long().cumprod(0).sum()) if k else 0
    if n == k:
        dist = p[k]
    else:
        q_n = q[n] if q is not None else torch.nn.functional.one_hot(draft[n], p.shape[-1]).to(p.dtype)
        dist = (p[n] - q_n).clamp_min(0)
        if float(dist.sum()) <= 0:  # p == q exactly: any rejection is measure-zero
            dist = p[n]
    return n, int(torch.multinomial(dist, 1, generator=generator))


def _extend_to_eos(generated: list[int], new: list[int], eos_ids: set[int]) -> int:
    """Append one verify step's tokens to `generated` (in place), up to and including the
    first EOS among them: an accepted draft token can be the EOS, and decoding stops
    there as plain greedy does. Returns the last token kept."""
    for tok in new:
        generated.append(tok)
        if tok in eos_ids:
            break
    return generated[-1]


@torch.no_grad()
def speculative_decode(
    model,
    prompt: list[int],
    drafter,
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float = 0.0,
    generator=None,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy_drafts: bool = False,
    shared: Prefill | None = None,
) -> DecodeTrace:
    """Draft / verify / accept until EOS or `max_new_tokens` (the output is truncated there).
    `top_k` / `top_p` and `greedy_drafts` matter only at temperature > 0 (module docstring).
    `shared`: the prompt's prefill, used when it holds the drafter's aux states."""
    draft_temperature = 0.0 if greedy_drafts else temperature
    device = model.get_output_embeddings().weight.device
    cache, first, prompt_aux, before = _start(model, prompt, drafter.aux_layer_ids, shared)
    trace = DecodeTrace(tokens=[], seconds=0.0, forwards=1)
    start = time.perf_counter() - before
    with capture_aux(model, drafter.aux_layer_ids) as grabbed:
        if temperature > 0:
            last = int(
                torch.multinomial(serving_probs(first, temperature, top_k, top_p), 1, generator=generator)
            )
        else:
            last = int(first.argmax(-1))
        drafter.start(prompt, last, prompt_aux)
        generated = [last]
        while last not in eos_ids and len(generated) < max_new_tokens:
            draft, q = drafter.propose(k, draft_temperature, generator)
            draft = draft.to(device)
            kd = draft.shape[0]
            verify_in = torch.cat([torch.tensor([last], device=device), draft])[None]
            logits = model(input_ids=verify_in, cache=cache, use_cache=True).logits[0]
            trace.forwards += 1
            if temperature <= 0:
                pred = logits.argmax(-1)
                n = int((draft == pred[:kd]).long().cumprod(0).sum()) if kd else 0
                bonus = int(pred[n])
            else:
                p = serving_probs(logits, temperature, top_k, top_p)
                # one row per verify step, empty where nothing was drafted (prompt lookup
                # finds no match), so expected[i] stays step i's as contexts[i] is
                expected = []
                if kd:
                    q_full = (
                        q.to(p) if q is not None else torch.nn.functional.one_hot(draft, p.shape[-1]).to(p)
                    )
                    expected = torch.minimum(p[:kd], q_full).sum(-1).tolist()
                trace.expected.append(expected)
                n, bonus = rejection_sample(p, q.to(p) if q is not None else None, draft, generator)
            new = draft[:n].tolist() + [bonus]
            cache.crop(-(kd - n))
            trace.contexts.append(len(prompt) + len(generated))
            trace.drafted.append(kd)
            trace.accepted.append(n)
            aux = grabbed.get("aux")
            drafter.commit(new, aux[0, : n + 1] if aux is not None else None)
            last = _extend_to_eos(generated, new, eos_ids)
    trace.tokens = generated[:max_new_tokens]
    trace.seconds = time.perf_counter() - start
    return trace


@torch.no_grad()
def replay_greedy(
    model,
    prompt: list[int],
    reference: list[int],
    drafter,
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    shared: Prefill | None = None,
) -> DecodeTrace:
    """The trace `speculative_decode` gives at temperature 0, walked over the plain greedy
    output `reference` instead of decoded: under greedy a draft token is accepted exactly
    when it equals the target's next greedy token, which `reference` already holds. A head
    reads the target's states at the accepted slots: one forward over `reference` after the
    prompt's prefill (`shared` when it holds them) gives them all, equal to the verify
    forwards' up to float rounding; its chain stops at the first draft `reference` rejects
    (`propose(truth=...)`). Only a draft that runs past the end of `reference` (over its
    EOS or its `max_new_tokens`) still matching needs the target again: one forward over
    the context gives the tokens there. `seconds` is 0: nothing was timed, so tok/s stays
    unmeasured (DESIGN §6)."""
    device = model.get_output_embeddings().weight.device
    aux = None
    if drafter.aux_layer_ids:
        cache, _, prompt_aux, _ = _start(model, prompt, drafter.aux_layer_ids, shared)
        with capture_aux(model, drafter.aux_layer_ids) as grabbed:
            model(
                input_ids=torch.tensor([reference], device=device),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        aux = torch.cat([prompt_aux, grabbed["aux"][0]])  # the target's states at every position
    trace = DecodeTrace(tokens=[], seconds=0.0, forwards=1)
    last = reference[0]
    drafter.start(prompt, last, aux[: len(prompt)] if aux is not None else None)
    generated = [last]
    while last not in eos_ids and len(generated) < max_new_tokens:
        g = len(generated)
        truth = reference[g : g + k + 1]  # the target's greedy token at positions g .. g+k
        draft = drafter.propose(k, truth=truth)[0].tolist()
        kd = len(draft)
        n = 0
        while n < kd and n < len(truth) and draft[n] == truth[n]:
            n += 1
        if n == len(truth):  # every known position matched: the target decides the rest
            ids = torch.tensor([prompt + generated + draft], device=device)
            truth = model(input_ids=ids).logits[0, len(prompt) + g - 1 :].argmax(-1).tolist()
            while n < kd and draft[n] == truth[n]:
                n += 1
        new = draft[:n] + [truth[n]]
        trace.forwards += 1
        trace.contexts.append(len(prompt) + g)
        trace.drafted.append(kd)
        trace.accepted.append(n)
        # the verify forward's states: the slots of `last` and the accepted drafts
        start = len(prompt) + g - 1
        drafter.commit(new, aux[start : start + n + 1] if aux is not None else None)
        last = _extend_to_eos(generated, new, eos_ids)
    trace.tokens = generated[:max_new_tokens]
    return trace


class HeadDrafter:
    """An EAGLE-3 or P-EAGLE head behind the drafter interface. It keeps the head's KV
    cache across steps and feeds `head.draft` the step-0 entries committed since the
    last call: slot t carries token x_{t+1}, the target's aux states at t, position t."""

    name = "head"

    def __init__(self, head):
        self.head = head
        self.aux_layer_ids = tuple(head.config.aux_layer_ids)
        param = head.lm_head.weight
        self.device, self.vocab_size = param.device, head.config.vocab_size
        self._draft_ids = head.draft_token_ids()

    def start(self, prompt: list[int], first_token: int, aux: torch.Tensor) -> None:
        self.cache = self.head.new_cache()
        self._pending = (prompt[1:] + [first_token], aux)
        self._next_pos = 0

    def commit(self, new_tokens: list[int], aux: torch.Tensor) -> None:
        self._pending = (new_tokens, aux)

    def propose(self, k: int, temperature: float = 0.0, generator=None, truth: list[int] | None = None):
        """-> (draft target ids [k], q [k, Vt] at temperature > 0 else None). `truth`: the
        target's greedy tokens at the draft positions, as far as known (a greedy replay):
        the chain stops at the first draft that differs, and the ids it did not draft are
        -1 (nothing after a rejected draft is accepted)."""
        tokens, aux = self._pending
        n = len(tokens)
        positions = torch.arange(self._next_pos, self._next_pos + n, device=self.device)[None]
        ids, logits = self.head.draft(
            self.cache,
            torch.tensor([tokens], device=self.device),
            aux[None].to(self.device),
            positions,
            k,
            temperature,
            generator,
            keep_going=None if truth is None else lambda j, ids: j >= len(truth) or int(ids[0]) == truth[j],
        )
        self._next_pos += n
        if ids.shape[1] < k:
            ids = torch.cat([ids, ids.new_full((1, k - ids.shape[1]), -1)], dim=1)
        q = None
        if temperature > 0:
            q_draft = torch.softmax(logits[0].float() / temperature, dim=-1)
            q = q_draft.new_zeros(k, self.vocab_size)
            q[:, self._draft_ids] = q_draft
        return ids[0], q
