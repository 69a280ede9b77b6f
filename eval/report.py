"""The evaluation report: a printed table with its warnings, JSON, markdown and a PNG,
plus `eval_report.json` (the exporter's model card reads it). The numbers in it come from
eval/trace_summary.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.core.run_paths import RunPaths
from eyas.eval.context_buckets import context_lines, plot_by_context

# A head whose first draft token the target accepts less than this often predicts it
# poorly. Judged at position 1, not by TAR: TAR falls with K as deep positions decay, so
# at K = 5 a head at tau 2.4 (a1 57%) has a TAR of only 28%.
LOW_FIRST_ACCEPTANCE = 0.30
# A draft vocabulary holding less of what the target writes caps every position's
# acceptance at that share.
LOW_VOCAB_COVERAGE = 0.80
REPORT_NAME = RunPaths.EVAL_REPORT


def verdicts(report: dict) -> list[str]:
    """Warnings a user must see: a low first-token acceptance, a head that loses to prompt
    lookup, a head slower than plain here (what that tok/s measures), lossless failures."""
    lines = []
    drafters = report.get("drafters", {})
    head, ngram = drafters.get("head"), drafters.get("ngram")
    first = (head or {}).get("per_position_acceptance") or [None]
    if first[0] is not None and first[0] < LOW_FIRST_ACCEPTANCE:
        lines.append(
            f"WARNING: the target accepts the head's first draft token {first[0]:.1%} of the time, "
            f"below {LOW_FIRST_ACCEPTANCE:.0%}: the head predicts the target poorly (too little training "
            "data or too few steps; near 0: a wrong target, wrong aux layers or a vocabulary-map problem)"
        )
    if (
        head
        and ngram
        and head.get("tau") is not None
        and ngram.get("tau") is not None
        and head["tau"] <= ngram["tau"]
    ):
        lines.append(
            f"WARNING: the head (tau {head['tau']:.2f}) does not beat prompt lookup (tau "
            f"{ngram['tau']:.2f}): "
            "not worth serving; use vLLM's n-gram drafter instead"
        )
    lines += _slower_than_plain(report)
    for name, share in (report.get("draft_vocab_coverage") or {}).items():
        if share < LOW_VOCAB_COVERAGE:
            lines.append(
                f"WARNING: {name}'s draft vocabulary holds {share:.1%} of the tokens the target wrote on "
                f"this workload, below {LOW_VOCAB_COVERAGE:.0%}: it can never propose the rest (a larger "
                "head.draft_vocab_size, or a vocabulary counted on this workload's data)"
            )
    lossless = report.get("lossless", {})
    for m in lossless.get("mismatches", []):
        kind = (
            "near-tie (numerical)"
            if m["near_tie"]
            else ("MISMATCH" if lossless.get("exact", True) else "verify-pass numerics")
        )
        lines.append(
            f"{kind}: {m['drafter']} differs from plain greedy on prompt {m['prompt_id']} turn {m['turn']} "
            f"at token {m['position']} (expected {m['expected']}, got {m['got']}, top-2 margin "
            f"{m['margin']:.4f})"
        )
    return lines


def _slower_than_plain(report: dict) -> list[str]:
    """A drafter that accepts tokens (tau > 1) yet decodes slower than plain here: say what
    this eval's tok/s measures, so it is not read as the speed the head gives when served."""
    plain = (report.get("plain") or {}).get("tokens_per_s")
    slow = [
        name
        for name, s in report.get("drafters", {}).items()
        if plain and s.get("tokens_per_s") and (s.get("tau") or 0) > 1 and s["tokens_per_s"] < plain
    ]
    if not slow:
        return []
    return [
        f"note: {', '.join(slow)} decoded slower than plain here despite tau > 1. This eval decodes one "
        f"sequence at a time with the target in eager transformers on {report.get('device', '?')}, "
        "where a draft step and the K+1-token verify of a small target cost about what the saved "
        "forwards do; the speed a head gives when served: `eyas bench-serve`"
    ]


def _fmt(x, pct=False):
    if x is None:
        return "-"
    return f"{x:.1%}" if pct else f"{x:.2f}"


def table_rows(report: dict) -> list[list[str]]:
    k = report["k"]
    header = ["drafter", "tau", "TAR", *[f"a{i + 1}" for i in range(k)], "tok/s", "speedup"]
    rows = [header]
    plain = report["plain"]
    rows.append(["plain greedy", "1.00", "-", *["-"] * k, _fmt(plain.get("tokens_per_s")), "1.00"])
    for name, s in report["drafters"].items():
        rates = (s.get("per_position_acceptance") or [None] * k)[:k]
        speed = s.get("tokens_per_s")
        ratio = speed / plain["tokens_per_s"] if speed and plain.get("tokens_per_s") else None
        rows.append(
            [
                name,
                _fmt(s.get("tau")),
                _fmt(s.get("tar"), True),
                *[_fmt(r, True) for r in rates],
                _fmt(speed),
                _fmt(ratio),
            ]
        )
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


def _replay_notes(report: dict) -> list[str]:
    lines = [
        f"{name}: replayed over the plain greedy tokens (the tau and acceptance decoding gives; tok/s not "
        "measured: --decode-baseline decodes it)"
        for name in report.get("replayed", [])
    ]
    decoded, prompts = report.get("decoded_prompts", report["num_prompts"]), report["num_prompts"]
    if decoded < prompts:
        lines.append(
            f"decoded against the target on {decoded} of the {prompts} prompts (tok/s and the lossless check "
            f"there), replayed over the plain greedy tokens on the other {prompts - decoded} (the same "
            "acceptance up to float rounding): --decoded-prompts sets how many"
        )
    return lines


def _paired_lines(report: dict) -> list[str]:
    pairs = report.get("paired_vs_head") or {}
    if not pairs:
        return []
    return [
        "tau minus the head's, paired over the same sequences (± se): "
        + ", ".join(f"{n} {d['difference']:+.3f} ±{d['se']:.3f}" for n, d in pairs.items())
    ]


def format_report(report: dict) -> str:
    lines = [
        f"target {report['target']}  head {report.get('head') or '-'}  workload {report['workload']}  "
        f"K={report['k']}  temperature={report['temperature']}  prompts={report['num_prompts']} "
        f"turns={report['num_sequences']}",
        format_table(table_rows(report)),
    ]
    lines += _replay_notes(report)
    lines += _paired_lines(report)
    cats = report.get("per_category", {})
    if cats:
        lines.append("per category (tau):")
        for cat, by in sorted(cats.items()):
            lines.append("  " + cat + ": " + ", ".join(f"{n} {_fmt(s.get('tau'))}" for n, s in by.items()))
    turns = report.get("per_turn", {})
    if len(turns) > 1:
        lines.append(
            "per turn (tau): "
            + "; ".join(
                f"turn {t}: " + ", ".join(f"{n} {_fmt(s.get('tau'))}" for n, s in by.items())
                for t, by in turns.items()
            )
        )
    lines += context_lines(report)
    lines += _coverage_lines(report)
    lossless = report.get("lossless")
    if lossless and lossless.get("checked"):
        lines.append(lossless_line(lossless))
    lines += verdicts(report)
    return "\n".join(lines)


def _coverage_lines(report: dict) -> list[str]:
    coverage = report.get("draft_vocab_coverage") or {}
    if not coverage:
        return []
    held = ", ".join(f"{n} {share:.1%}" for n, share in coverage.items())
    return [f"draft vocabulary coverage (the target's tokens here a head could propose): {held}"]


def lossless_line(lossless: dict) -> str:
    """PASSED / FAILED where the check is exact (float32); elsewhere the mismatch rate and
    its causes, since reduced precision makes a good head differ too (eval/evaluate.py)."""
    n, differing, ties = lossless["checked"], len(lossless["mismatches"]), lossless["near_ties"]
    if lossless.get("exact", True) or lossless["passed"]:
        verdict = "PASSED" if lossless["passed"] else "FAILED"
        return f"lossless check: {verdict} ({n} sequences, {differing} differing)"
    return (
        f"lossless check in {lossless['dtype']} (not exact): {lossless['mismatch_rate']:.1%} of {n} "
        f"sequences differ ({ties} near ties; {differing - ties} beyond the "
        f"{lossless['tie_tolerance']} tolerance: verify-pass vs one-token numerics); eval.dtype=float32 "
        "checks exactly"
    )


def markdown(report: dict) -> str:
    rows = table_rows(report)
    md = [
        "# Offline speculative-decoding evaluation",
        "",
        f"- target: `{report['target']}`",
        f"- head: `{report.get('head') or '-'}`",
        f"- workload: `{report['workload']}` ({report['num_prompts']} prompts, "
        f"{report['num_sequences']} turns)",
        f"- K = {report['k']}, temperature = {report['temperature']}, max_new_tokens = "
        f"{report['max_new_tokens']}",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
    ]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    md += [
        "",
        "tau = tokens per target forward; a_k = acceptance of draft position k given 1..k-1 accepted; "
        "TAR = accepted / proposed; tok/s measured on this machine.",
    ]
    md += [f"- {n}" for n in _replay_notes(report) + _paired_lines(report) + _coverage_lines(report)]
    by_context = context_lines(report)
    if by_context:
        md += ["", "```", *by_context, "```"]
    notes = verdicts(report)
    if notes:
        md += [""] + [f"- {n}" for n in notes]
    return "\n".join(md) + "\n"


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = report["k"]
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    names = list(report["drafters"])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rates = [
            r if r is not None else 0.0
            for r in (report["drafters"][name].get("per_position_acceptance") or [0.0] * k)
        ]
        tau = report["drafters"][name].get("tau")
        ax.bar(
            [p + 1 + (i - (len(names) - 1) / 2) * width for p in range(k)],
            rates,
            width,
            label=f"{name} (tau {tau:.2f})" if tau is not None else name,
        )
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance given 1..k-1 accepted")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['workload']}, K={report['k']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: bars reach the top
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(report: dict, out_dir: str | Path) -> dict[str, str]:
    """eval_report.json, eval_report.md, eval_report.png and (with any draft step)
    eval_by_context.png under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / REPORT_NAME,
        "markdown": out / RunPaths.EVAL_REPORT_MD,
        "png": out / RunPaths.EVAL_PLOT,
    }
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(markdown(report))
    plot(report, paths["png"])
    if plot_by_context(report, out / RunPaths.EVAL_CONTEXT_PLOT):
        paths["context_png"] = out / RunPaths.EVAL_CONTEXT_PLOT
    return {k: str(v) for k, v in paths.items()}
