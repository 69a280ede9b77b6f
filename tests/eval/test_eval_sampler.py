"""`eval.sampler: vllm` (DESIGN §6): at temperature > 0 the offline eval drafts and accepts
as vLLM does, checked against a direct simulation of vLLM's rule written here from its
definition: the target's distribution is the logits over the temperature, cut to the
top-k and then to the top-p nucleus; a greedy draft token x is accepted with that
probability p(x); a rejected position is resampled from p without x."""

import math

import numpy as np
import pytest
import torch
from test_eval_speculate import bigram_target, copy_head

from eyas.eval.speculate import HeadDrafter, speculative_decode
from eyas.eval.trace_summary import summarize
from eyas.target.features import target_norm_and_lm_head


def vllm_rule_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row: vLLM's distribution, token by token in plain numpy."""
    z = logits.astype(np.float64) / temperature
    keep = np.ones_like(z, dtype=bool)
    if top_k:
        keep = z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        dropped_mass = 0.0
        for tok in np.argsort(p)[:-1]:  # least likely first; the most likely always stays
            if p[tok] == 0.0:
                continue
            if dropped_mass + p[tok] > 1.0 - top_p + 1e-12:
                break
            dropped_mass += p[tok]
            p[tok] = 0.0
        p /= p.sum()
    return p


class RankDrafter:
    """Drafts, at position j, the token of rank `ranks[j]` under the bigram target's
    logits after the previous token (rank 0: its argmax), so a draft position can be the
    second choice or fall outside the top-k. It logs every step for the simulation."""

    name, aux_layer_ids = "ranks", ()

    def __init__(self, table: torch.Tensor, ranks: list[int]):
        self.order, self.ranks, self.log = table.argsort(-1, descending=True), ranks, []

    def start(self, prompt, first_token, aux=None):
        self.last = first_token

    def propose(self, k, temperature=0.0, generator=None):
        assert temperature == 0.0, "vLLM drafts greedily: the drafter must not be asked to sample"
        ids, prev = [], self.last
        for r in self.ranks[:k]:
            prev = int(self.order[prev, r])
            ids.append(prev)
        self.log.append({"prev": self.last, "draft": ids})
        return torch.tensor(ids), None

    def commit(self, new_tokens, aux=None):
        self.log[-1]["new"] = list(new_tokens)
        self.last = new_tokens[-1]


@torch.no_grad()
def _bigram_logits(model) -> torch.Tensor:
    """[V, V]: the bigram target's logits after each token."""
    norm, lm = target_norm_and_lm_head(model)
    return lm(norm(model.get_input_embeddings().weight)).float()


def test_vllm_sampler_matches_a_direct_simulation_of_vllms_rule(tiny_llama_dir):
    # a flat bigram target: the top-p cut after the top-6 keeps 4 to 5 tokens
    target, _ = bigram_target(tiny_llama_dir, beta=0.08)
    model = target.model
    table = _bigram_logits(model)
    temperature, top_k, top_p, k = 0.8, 6, 0.8, 4
    # rank 6 is outside the top 6: that position is never accepted, the chain stops there
    drafter = RankDrafter(table, [0, 1, 0, 6])
    g = torch.Generator().manual_seed(0)
    traces = []
    prompts = torch.randint(4, 300, (20, 8), generator=torch.Generator().manual_seed(1)).tolist()
    for prompt in prompts:
        traces.append(
            speculative_decode(
                model,
                prompt,
                drafter,
                k,
                24,
                set(),
                temperature,
                g,
                top_k=top_k,
                top_p=top_p,
                greedy_drafts=True,
            )
        )
    steps = [s for tr in traces for s in zip(tr.accepted, tr.expected)]
    assert len(steps) == len(drafter.log)
    ref = {}
    observed, expected, variance = np.zeros(k), np.zeros(k), np.zeros(k)
    for (accepted, got), entry in zip(steps, drafter.log):
        prev, chain = entry["prev"], 1.0
        for pos, tok in enumerate(entry["draft"]):
            if prev not in ref:
                ref[prev] = vllm_rule_probs(table[prev].numpy(), temperature, top_k, top_p)
            a = ref[prev][tok]
            # the eval's own per-position acceptance probability is vLLM's p(x), exactly
            assert got[pos] == pytest.approx(a, abs=1e-5), (entry, pos)
            chain *= a
            expected[pos] += chain
            variance[pos] += chain * (1 - chain)
            observed[pos] += accepted > pos
            prev = tok
        if accepted < k:  # the resampled token is drawn from p without the rejected draft
            recovered = entry["new"][accepted]
            assert recovered != entry["draft"][accepted]
            assert ref[entry["draft"][accepted - 1] if accepted else entry["prev"]][recovered] > 0
    assert observed[3] == 0 and expected[3] == 0
    assert observed[0] > 50 and observed[1] > 8  # the first positions both accept and reject
    for pos in range(3):
        assert abs(observed[pos] - expected[pos]) < 4 * math.sqrt(variance[pos]) + 1, pos
    rates = summarize(traces, k)["per_position_acceptance"]
    assert rates[0] == pytest.approx(observed[0] / len(steps))


def test_vllm_greedy_drafts_differ_from_the_exact_rule(tiny_llama_dir):
    """A head whose distribution is flatter than the target's: vLLM's greedy drafts are
    accepted with p(argmax), the exact rule's sampled ones with sum_v min(p, q); the two
    expectations differ, and each sampler reports its own."""
    target, _ = bigram_target(tiny_llama_dir, beta=0.35)
    model = target.model
    table = _bigram_logits(model)
    head = copy_head(model, "eagle3", lm_scale=0.5)
    prompt = list(range(10, 22))
    out = {}
    for greedy in (True, False):
        g = torch.Generator().manual_seed(0)
        traces = [
            speculative_decode(model, prompt, HeadDrafter(head), 3, 20, set(), 1.0, g, greedy_drafts=greedy)
            for _ in range(6)
        ]
        out[greedy] = summarize(traces, 3)["expected_acceptance"][0]
    # the copy head's argmax is the target's: accepted with the target's top probability
    top = torch.softmax(table, -1).max(-1).values
    assert top.min() <= out[True] <= top.max()
    assert out[True] > out[False] + 0.05
