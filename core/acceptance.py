"""Acceptance arithmetic shared by the trainer's metrics, the evaluator and the planner."""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens_per_step(per_position_acceptance: Sequence[float]) -> float:
    """E = 1 + sum_k prod_{j<=k} a_j: the tokens one target forward yields when draft
    position k is accepted with conditional probability a_k (DESIGN §6). For a constant
    rate a over K positions this is (1 - a^(K+1)) / (1 - a)."""
    total, run = 1.0, 1.0
    for a in per_position_acceptance:
        run *= float(a)
        total += run
    return total


def conditional_acceptance(drafts: float, accepted_per_position: Sequence[float]) -> list[float]:
    """Per-position acceptance a_k = accepted at position k / accepted at k - 1 (drafts for
    k = 1), from counts; the list stops where a position was never reached."""
    rates, reached = [], float(drafts)
    for hits in accepted_per_position:
        if reached <= 0:
            break
        rates.append(hits / reached)
        reached = hits
    return rates
