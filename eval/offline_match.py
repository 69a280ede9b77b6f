"""eyas's offline τ on exactly what `eyas bench-serve` served (DESIGN §6.2): the same
prompt token ids, token budget, drafters, K and temperatures, decoded by eyas's own loop
(eval/speculate.py, vLLM's rule at T > 0: greedy drafts accepted with the target's
probability) in float32 and in the engine's dtype, so offline τ and the engine's tokens
per forward can be set side by side. At T > 0 each τ carries its seeded sampling
interval (± 2 standard errors over the requests).
"""

from __future__ import annotations

import math

from eyas.eval.trace_summary import summarize

# What eyas's offline decoding computes, as a number a saved offline.json is keyed by: bumped
# when a change of eyas moves its τ for the same settings, so a rerun does not reuse the old
# one (2: the head runs in the target's dtype, eval/evaluate.py::load_eval_head).
OFFLINE_RULE = 2


def tau_interval(traces) -> tuple[float, float, float]:
    """(τ, low, high): τ = 1 + accepted / steps over all requests (§6's τ), ± 2 standard errors
    of that ratio over the requests (the delta method for a ratio of sums)."""
    acc = [sum(t.accepted) for t in traces]
    steps = [len(t.accepted) for t in traces]
    total_steps = sum(steps)
    if not total_steps:
        return 1.0, 1.0, 1.0
    r = sum(acc) / total_steps
    n = len(traces)
    if n < 2:
        return 1.0 + r, 1.0 + r, 1.0 + r
    mean_steps = total_steps / n
    var = sum((a - r * s) ** 2 for a, s in zip(acc, steps)) / (n * (n - 1) * mean_steps**2)
    half = 2.0 * math.sqrt(var)
    return 1.0 + r, 1.0 + r - half, 1.0 + r + half


def offline_taus(
    target_path: str,
    prompts: list[list[int]],
    drafters: list,
    ks: list[int],
    temperatures: list[float],
    max_tokens: int,
    dtypes: list[str],
    seed: int = 0,
) -> list[dict]:
    """One entry per (drafter, K, temperature, dtype) of the bench's speculative drafters
    (`eval.bench_serve.Drafter`): τ and, at T > 0, its interval."""
    import torch

    from eyas.eval.evaluate import load_eval_head
    from eyas.eval.ngram import NgramDrafter
    from eyas.eval.speculate import HeadDrafter, speculative_decode
    from eyas.target.load import load_target, stop_token_ids

    out = []
    for dtype in dtypes:
        target = load_target(target_path, dtype=dtype, device="cpu")
        eos = stop_token_ids(target.model, target.tokenizer)
        for d in drafters:
            if d.kind == "plain":
                continue
            head = load_eval_head(d.path, target) if d.kind == "head" else None
            for k in ks:
                for t in temperatures:
                    traces = []
                    for i, prompt in enumerate(prompts):
                        drafter = (
                            HeadDrafter(head) if head is not None else NgramDrafter(d.ngram_min, d.ngram_max)
                        )
                        gen = torch.Generator().manual_seed(seed * 1_000_003 + i) if t > 0 else None
                        traces.append(
                            speculative_decode(
                                target.model, prompt, drafter, k, max_tokens, eos, t, gen, greedy_drafts=True
                            )
                        )
                    tau, low, high = tau_interval(traces)
                    out.append(
                        {
                            "drafter": d.name,
                            "k": k,
                            "temperature": t,
                            "dtype": dtype,
                            "tau": tau,
                            "interval": [low, high] if t > 0 else None,
                            "per_position_acceptance": summarize(traces, k).get("per_position_acceptance"),
                        }
                    )
    return out


def side_by_side(offline: list[dict], points: list[dict], concurrency: int) -> list[dict]:
    """Each offline entry with the engine's tokens per forward for the same drafter, K and
    temperature at `concurrency` (None where that level was not measured)."""
    served = {
        (p["drafter"], p["k"], p["temperature"]): p["tokens_per_forward"]
        for p in points
        if p["concurrency"] == concurrency and p["kind"] != "plain"
    }
    out = []
    for e in offline:
        tpf = served.get((e["drafter"], e["k"], e["temperature"]))
        out.append(
            {**e, "served_tokens_per_forward": tpf, "served_over_offline": tpf / e["tau"] if tpf else None}
        )
    return out
