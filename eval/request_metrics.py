"""Acceptance per request, where the engine reports it (DESIGN §6.2): vLLM's
`--per-request-spec-decode-metrics summary` adds `metrics.speculative_decoding` to a
streamed completion's final usage chunk (steps, draft and accepted tokens, a histogram
of accepted drafts per step). Engines without the option get only the global counters.
"""

from __future__ import annotations

import subprocess

from eyas.core.acceptance import conditional_acceptance
from eyas.eval.context_buckets import DEFAULT_EDGES, bucket_index, bucket_labels

ENGINE_FLAG = ["--per-request-spec-decode-metrics", "summary"]
NOT_OFFERED = "not offered by this engine (no --per-request-spec-decode-metrics): global counters only"
_PROBE = (
    "from vllm.config.observability import ObservabilityConfig as O; "
    "print(hasattr(O, 'per_request_spec_decode_metrics'))"
)


def engine_offers(vllm_python: str) -> bool:
    """Whether the engine's vLLM has `--per-request-spec-decode-metrics` (vLLM 0.32 does)."""
    try:
        done = subprocess.run([vllm_python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip().endswith("True")


def request_record(prompt_tokens: int, spec: dict, output_tokens: int = 0) -> dict:
    """The numbers kept of one request's `metrics.speculative_decoding`."""
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "steps": int(spec.get("num_spec_steps", 0)),
        "draft_tokens": int(spec.get("num_draft_tokens", 0)),
        "accepted": int(spec.get("num_accepted_draft_tokens", 0)),
        "histogram": [int(n) for n in spec.get("acceptance_histogram") or []],
    }


def group_summary(records: list[dict]) -> dict:
    """Steps, TAR, accepted drafts per step and conditional acceptance per position of a
    group of requests, from their summed histograms (index j: steps that accepted j)."""
    steps = sum(r["steps"] for r in records)
    drafted = sum(r["draft_tokens"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    width = max((len(r["histogram"]) for r in records), default=0)
    hist = [sum(r["histogram"][j] for r in records if j < len(r["histogram"])) for j in range(width)]
    rates = conditional_acceptance(sum(hist), [sum(hist[j:]) for j in range(1, width)])
    return {
        "requests": len(records),
        "prompt_tokens": [min(r["prompt_tokens"] for r in records), max(r["prompt_tokens"] for r in records)]
        if records
        else None,
        "steps": steps,
        "tar": accepted / drafted if drafted else None,
        "accepted_per_step": accepted / steps if steps else None,
        "per_position_acceptance": rates,
    }


def by_prompt_length(records: list[dict], groups: int = 3) -> list[dict]:
    """The requests in `groups` groups of near-equal size by prompt length, shortest first."""
    ordered = sorted(records, key=lambda r: r["prompt_tokens"])
    n = len(ordered)
    bounds = [round(i * n / groups) for i in range(groups + 1)]
    return [group_summary(ordered[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def per_request_fields(results) -> dict:
    """The engine's per-request acceptance of a level's `RequestResult`s (eval/bench_serve.py),
    when it reported it: one record per request (in prompt order), the requests grouped by
    prompt length and in context buckets (the context halfway through a request's output,
    eval/context_buckets.py)."""
    if not any(r.spec for r in results):
        return {}
    records = [request_record(r.prompt_tokens, r.spec, r.output_tokens) for r in results if r.spec]
    return {
        "per_request": records,
        "by_prompt_length": by_prompt_length(records),
        "by_context": records_by_context(records),
    }


def request_context(record: dict) -> float:
    """A served request's context halfway through its output (its steps' mean context)."""
    return record["prompt_tokens"] + record.get("output_tokens", 0) / 2


def records_by_context(records: list[dict], edges=DEFAULT_EDGES) -> dict[str, dict]:
    """Per-request engine records -> {bucket label: their group summary}."""
    labels = bucket_labels(edges)
    groups: dict[int, list[dict]] = {}
    for r in records:
        groups.setdefault(bucket_index(request_context(r), edges), []).append(r)
    return {labels[b]: group_summary(rs) for b, rs in sorted(groups.items())}
