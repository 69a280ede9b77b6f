"""The lossless check of the offline eval (DESIGN §6): where a drafter's greedy output
leaves plain greedy decoding, why (a near tie, reduced-precision numerics, or drafting),
and the verdict over every decoded sequence."""

from __future__ import annotations

import torch

# A greedy mismatch where the target's own top-2 logits are this close is rounding noise
# of the verify pass (K+1 positions) against the one-token pass, not a drafting bug.
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.15}
EXACT_DTYPES = (torch.float32, torch.float64)  # where the verify and one-token passes agree


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatch_record(plain, decoded, drafter: str, prompt, turn: int, tol: float, exact: bool) -> list[dict]:
    """[] when `decoded`'s tokens equal `plain`'s, else the one record of where and why
    they first differ (`turn` counted from 0)."""
    pos = first_difference(plain.tokens, decoded.tokens)
    if pos is None:
        return []
    margin = plain.margins[pos] if pos < len(plain.margins) else float("inf")
    near_tie = margin <= tol
    return [
        {
            "drafter": drafter,
            "prompt_id": prompt.id,
            "turn": turn + 1,
            "position": pos,
            "expected": plain.tokens[pos] if pos < len(plain.tokens) else None,
            "got": decoded.tokens[pos] if pos < len(decoded.tokens) else None,
            "margin": margin,
            "near_tie": near_tie,
            "cause": mismatch_cause(near_tie, exact),
            "prompt": prompt.turns[turn][:200],
        }
    ]


def mismatch_cause(near_tie: bool, exact: bool) -> str:
    """Why a greedy speculative output left plain greedy decoding at one token."""
    if near_tie:
        return "one-token numerics: the target's top two logits were within the tolerance"
    if not exact:
        return (
            "verify-pass numerics: the K+1-position pass and the one-token pass round differently in "
            "reduced precision (a bf16 MoE also flips routes)"
        )
    return "drafting: the speculative output is not the target's greedy output"


def lossless_verdict(mismatches: list[dict], checked: int, tol: float, exact: bool, dtype) -> dict:
    """The lossless check. In float32 (`exact`) it passes or fails: only near ties may
    differ. In reduced precision the two passes round differently, so a good head differs
    too; there it is a mismatch rate with its causes, `passed` None (undecided) when a
    mismatch is beyond the tolerance, instead of a FAILED no head could avoid."""
    beyond = [m for m in mismatches if not m["near_tie"]]
    sequences = len({(m["drafter"], m["prompt_id"], m["turn"]) for m in mismatches})
    return {
        "checked": checked,
        "dtype": str(dtype).replace("torch.", ""),
        "exact": exact,
        "tie_tolerance": tol,
        "mismatches": mismatches,
        "mismatch_rate": sequences / checked if checked else 0.0,
        "near_ties": len(mismatches) - len(beyond),
        "passed": True if not beyond else (False if exact else None),
    }
