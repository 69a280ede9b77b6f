"""τ and per-position acceptance by context length (DESIGN §6): a head's acceptance falls
as the context grows, which one τ over short prompts hides. Each draft step is put in the
bucket of its context, the prompt (earlier turns included) plus the tokens generated
before that step; `eval.context_buckets` holds the bucket edges in tokens.

The engine (bench-serve) reports acceptance per request, not per step: there a request
falls in the bucket of its context halfway through its output.

This module holds the buckets, the split of traces, the table and the plot; the summaries sit
beside the ones they extend: summarize_by_context below (offline draft steps) and
eval/request_metrics.py::records_by_context (the engine's per-request records).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from eyas.eval.trace_summary import summarize

DEFAULT_EDGES = (2048, 8192, 32768)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def bucket_labels(edges=DEFAULT_EDGES) -> list[str]:
    """`[<2k, 2-8k, 8-32k, >=32k]` for the default edges."""
    labels = [f"<{_tokens(edges[0])}"]
    labels += [f"{_tokens(a)}-{_tokens(b)}" for a, b in zip(edges, edges[1:])]
    return labels + [f">={_tokens(edges[-1])}"]


def bucket_index(context: float, edges=DEFAULT_EDGES) -> int:
    return sum(context >= e for e in edges)


def split_by_context(traces, edges=DEFAULT_EDGES) -> dict[str, list]:
    """`DecodeTrace`s -> {bucket label: traces holding only that bucket's draft steps}
    (tokens and time are not split: a bucket's summary is about acceptance alone)."""
    labels = bucket_labels(edges)
    out: dict[str, list] = {}
    for t in traces:
        steps: dict[int, list[int]] = {}
        for i, context in enumerate(t.contexts):
            steps.setdefault(bucket_index(context, edges), []).append(i)
        for b, idx in sorted(steps.items()):
            part = replace(
                t,
                tokens=[],
                seconds=0.0,
                forwards=len(idx),
                drafted=[t.drafted[i] for i in idx],
                accepted=[t.accepted[i] for i in idx],
                expected=[t.expected[i] for i in idx] if t.expected else [],
                margins=[],
                contexts=[t.contexts[i] for i in idx],
            )
            out.setdefault(labels[b], []).append(part)
    return {label: out[label] for label in labels if label in out}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _se(x) -> str:
    return "" if x is None else f" ±{x:.2f}"


def context_lines(report: dict) -> list[str]:
    """The printed table: per drafter, τ (± its standard error over sequences,
    eval/trace_summary.py::tau_standard_error) and first-position acceptance in each bucket."""
    by_drafter = report.get("per_context") or {}
    labels = bucket_labels(report.get("context_buckets") or DEFAULT_EDGES)
    present = [label for label in labels if any(label in b for b in by_drafter.values())]
    if not present:
        return []
    rows = [["by context (tau ± se / a1 / steps)", *present]]
    for name, buckets in by_drafter.items():
        cells = []
        for label in present:
            b = buckets.get(label)
            a1 = (b or {}).get("per_position_acceptance") or [None]
            if b is None:
                cells.append("-")
                continue
            first = "-" if a1[0] is None else f"{a1[0]:.0%}"
            cells.append(f"{_fmt(b['tau'])}{_se(b.get('tau_se'))} / {first} / {b['steps']}")
        rows.append([name, *cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    ]


def plot_by_context(report: dict, path: Path) -> Path | None:
    """τ per context bucket, one line per drafter, and each bucket's acceptance per
    position beside it; None when no bucket has a step."""
    by_drafter = report.get("per_context") or {}
    labels = bucket_labels(report.get("context_buckets") or DEFAULT_EDGES)
    present = [label for label in labels if any(label in b for b in by_drafter.values())]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, buckets in by_drafter.items():
        left.plot(
            range(len(present)),
            [(buckets.get(label) or {}).get("tau") for label in present],
            marker="o",
            label=name,
        )
    left.set_xticks(range(len(present)), present)
    left.set_xlabel("context (prompt + generated) at the draft step, tokens")
    left.set_ylabel("tau (tokens per target forward)")
    left.legend(fontsize=8)
    head = by_drafter.get("head") or next(iter(by_drafter.values()))
    for label in present:
        rates = [
            r if r is not None else 0.0
            for r in ((head.get(label) or {}).get("per_position_acceptance") or [])
        ]
        if rates:
            right.plot(range(1, len(rates) + 1), rates, marker=".", label=label)
    right.set_xlabel("draft position k")
    right.set_ylabel("acceptance given 1..k-1 accepted")
    right.set_ylim(0, 1)
    right.set_title("head" if "head" in by_drafter else next(iter(by_drafter)), fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(f"{report['workload']}, K={report['k']}: acceptance by context length", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summarize_by_context(traces, k: int, edges=DEFAULT_EDGES) -> dict[str, dict]:
    """{bucket label: the §6 summary of its draft steps (τ, TAR, per-position acceptance)},
    buckets without a step left out; each also says the contexts it covers."""
    out = {}
    for label, parts in split_by_context(traces, edges).items():
        summary = summarize(parts, k)
        contexts = [c for p in parts for c in p.contexts]
        out[label] = {
            "steps": summary.get("verify_steps", 0),
            "context_range": [min(contexts), max(contexts)],
            **{key: summary.get(key) for key in ("tau", "tau_se", "tar", "per_position_acceptance")},
        }
    return out
