"""Statistics over `DecodeTrace`s (DESIGN §6): τ, TAR and per-position acceptance of one
drafter, τ's standard error with sequences as the unit, and the paired difference of two
drafters decoded over the same sequences. The report, the context buckets and the offline
match all summarize with these.

Definitions (DESIGN §6):
- tau: tokens per target verify forward, every decode step counted (a step whose drafter
  proposed nothing yields 1 token); the prefill forward is left out of both.
- per-position acceptance a_k: accepted at draft position k / steps that reached k
  (positions 1..k-1 accepted and a k-th token was proposed).
- TAR: accepted draft tokens / proposed draft tokens.
"""

from __future__ import annotations

from eyas.core.acceptance import expected_tokens_per_step


def _sequence_shares(traces) -> tuple[float, list[float]]:
    """(τ - 1 = Σ accepted / Σ verify steps, each sequence's share of its error by the delta
    method for a ratio of sums: (accepted - rate · steps) / all steps)."""
    parts = [(sum(t.accepted), len(t.drafted)) for t in traces]
    steps = sum(n for _, n in parts)
    rate = sum(a for a, _ in parts) / steps
    return rate, [(a - rate * n) / steps for a, n in parts]


def _spread(shares: list[float]) -> float:
    m = len(shares)
    return (m / (m - 1) * sum(u * u for u in shares)) ** 0.5


def tau_standard_error(traces) -> float | None:
    """The standard error of τ with sequences as the unit: τ - 1 is a ratio (tokens
    accepted over verify steps) of sums over sequences, and the steps of one sequence move
    together (one easy prompt accepts long runs throughout), so the steps are not
    independent draws. None below two sequences with a step."""
    stepped = [t for t in traces if t.drafted]
    return _spread(_sequence_shares(stepped)[1]) if len(stepped) >= 2 else None


def paired_tau_difference(traces, base) -> dict | None:
    """τ of `traces` minus τ of `base`, two drafters decoded over the same sequences, with
    the standard error of the difference taken sequence by sequence: a prompt that is easy
    for one head is easy for the other, so pairing cancels most of the spread each τ has
    alone (`tau_standard_error`). None unless both cover the same two or more sequences."""
    if len(traces) != len(base) or len(traces) < 2:
        return None
    if not any(t.drafted for t in traces) or not any(t.drafted for t in base):
        return None
    (rate, ours), (base_rate, theirs) = _sequence_shares(traces), _sequence_shares(base)
    return {"difference": rate - base_rate, "se": _spread([u - v for u, v in zip(ours, theirs)])}


def paired_against_head(traces: dict) -> dict[str, dict]:
    """`paired_tau_difference` of every other drafter against the one named "head"."""
    if "head" not in traces:
        return {}
    pairs = {n: paired_tau_difference(t, traces["head"]) for n, t in traces.items() if n != "head"}
    return {n: d for n, d in pairs.items() if d is not None}


def summarize(traces, k: int) -> dict:
    """Aggregate `DecodeTrace`s of one drafter (or of plain decoding) into a summary dict."""
    steps = sum(len(t.drafted) for t in traces)
    proposed = sum(sum(t.drafted) for t in traces)
    accepted = sum(sum(t.accepted) for t in traces)
    reached, hit = [0] * k, [0] * k
    exp_sum, exp_n = [0.0] * k, [0] * k
    for t in traces:
        for d, a in zip(t.drafted, t.accepted):
            for pos in range(min(d, a + 1)):
                reached[pos] += 1
                hit[pos] += pos < a
        for row in t.expected:
            for pos, e in enumerate(row):
                exp_sum[pos] += e
                exp_n[pos] += 1
    rates = [h / r if r else None for h, r in zip(hit, reached)]
    known = []
    for r in rates:
        if r is None:
            break
        known.append(r)
    tokens = sum(len(t.tokens) for t in traces)
    seconds = sum(t.seconds for t in traces)
    timed_tokens = sum(len(t.tokens) for t in traces if t.seconds > 0)  # replayed traces: 0 s
    out = {
        "sequences": len(traces),
        "generated_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": timed_tokens / seconds if seconds > 0 else None,
        "target_forwards": sum(t.forwards for t in traces),
    }
    if steps:
        out.update(
            {
                "verify_steps": steps,
                "tau": (accepted + steps) / steps,
                "tar": accepted / proposed if proposed else 0.0,
                "proposed": proposed,
                "accepted": accepted,
                "per_position_acceptance": rates,
                "reached_per_position": reached,
                "tau_from_acceptance": expected_tokens_per_step(known),
            }
        )
        se = tau_standard_error(traces)
        if se is not None:
            out["tau_se"] = se
        if any(exp_n):
            out["expected_acceptance"] = [s / n if n else None for s, n in zip(exp_sum, exp_n)]
    return out
