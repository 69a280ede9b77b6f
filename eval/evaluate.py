"""The offline evaluation loop: every prompt turn is decoded plainly (greedy, the
reference output and the tokens/s baseline) and by each drafter; the report compares
them (DESIGN §6)."""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch

from eyas.data.targets import stop_token_ids
from eyas.eval.report import summarize
from eyas.eval.speculate import greedy_decode, replay_greedy, speculative_decode
from eyas.eval.workloads import WorkloadPrompt, render_turn

log = logging.getLogger(__name__)

# A greedy mismatch where the target's own top-2 logits are this close is rounding noise
# of the verify pass (K+1 positions) against the one-token pass, not a drafting bug.
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.15}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_eval(
    model,
    tokenizer,
    prompts: list[WorkloadPrompt],
    drafters: dict,
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    tie_tolerance: float | None = None,
    progress: bool = True,
    replay: Collection[str] = (),
) -> dict:
    """Decode every turn of every prompt plainly and with each drafter.

    `drafters`: name -> drafter (`HeadDrafter`, `NgramDrafter`). The drafters named in
    `replay` (token-only ones, greedy only) are walked over the plain output with
    `replay_greedy` instead of decoded: the same acceptance, no decode time, no tok/s.
    Returns the report body: plain / per-drafter summaries, per-category and per-turn
    summaries, the lossless check (greedy, decoded drafters), the names replayed.
    """
    replay = set(replay) if temperature <= 0 else set()
    unknown = replay - set(drafters)
    if unknown:
        raise ValueError(
            f"replay names {sorted(unknown)}, which are not among the drafters {sorted(drafters)}"
        )
    eos = stop_token_ids(model, tokenizer)
    device = model.get_output_embeddings().weight.device
    tol = TIE_TOLERANCE.get(model.dtype, 1e-4) if tie_tolerance is None else tie_tolerance
    plain_traces, traces = [], {name: [] for name in drafters}
    by_cat: dict[str, dict[str, list]] = {}
    by_turn: dict[int, dict[str, list]] = {}
    mismatches, checked = [], 0
    # Warm-up outside the timings (first calls allocate and pick kernels).
    warm = render_turn(tokenizer, prompts[0], [])
    greedy_decode(model, warm, 2, eos)
    for name, d in drafters.items():
        if name not in replay:
            speculative_decode(model, warm, d, k, 2, eos)
    turns_total = sum(len(p.turns) for p in prompts)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=turns_total, desc="eval", unit="turn")
    seq = 0
    for prompt in prompts:
        replies: list[str] = []
        for turn in range(len(prompt.turns)):
            ids = render_turn(tokenizer, prompt, replies)
            plain = greedy_decode(model, ids, max_new_tokens, eos)
            plain_traces.append(plain)
            cat = by_cat.setdefault(prompt.category, {name: [] for name in drafters})
            per_turn = by_turn.setdefault(turn + 1, {name: [] for name in drafters})
            for name, drafter in drafters.items():
                if name in replay:
                    tr = replay_greedy(model, ids, plain.tokens, drafter, k, max_new_tokens, eos)
                else:
                    gen = (
                        torch.Generator(device=device).manual_seed(seed * 1_000_003 + seq)
                        if temperature > 0
                        else None
                    )
                    tr = speculative_decode(model, ids, drafter, k, max_new_tokens, eos, temperature, gen)
                traces[name].append(tr)
                cat[name].append(tr)
                per_turn[name].append(tr)
                if temperature <= 0 and name not in replay:
                    checked += 1
                    pos = first_difference(plain.tokens, tr.tokens)
                    if pos is not None:
                        margin = plain.margins[pos] if pos < len(plain.margins) else float("inf")
                        mismatches.append(
                            {
                                "drafter": name,
                                "prompt_id": prompt.id,
                                "turn": turn + 1,
                                "position": pos,
                                "expected": plain.tokens[pos] if pos < len(plain.tokens) else None,
                                "got": tr.tokens[pos] if pos < len(tr.tokens) else None,
                                "margin": margin,
                                "near_tie": margin <= tol,
                                "prompt": prompt.turns[turn][:200],
                            }
                        )
            replies.append(tokenizer.decode(plain.tokens, skip_special_tokens=True))
            seq += 1
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return {
        "num_prompts": len(prompts),
        "num_sequences": seq,
        "plain": summarize(plain_traces, k),
        "drafters": {name: summarize(t, k) for name, t in traces.items()},
        "per_category": {c: {n: summarize(t, k) for n, t in d.items()} for c, d in by_cat.items()},
        # Later turns read the earlier replies (the target's own, plainly decoded) as context.
        "per_turn": {
            str(t): {n: summarize(tr, k) for n, tr in d.items()} for t, d in sorted(by_turn.items())
        },
        "replayed": sorted(replay),
        "lossless": {
            "checked": checked,
            "tie_tolerance": tol,
            "mismatches": mismatches,
            "passed": not any(not m["near_tie"] for m in mismatches),
        },
    }
