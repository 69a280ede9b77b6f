"""The report of `eyas bench-serve` (DESIGN §6.2): measured levels -> the speedup table per
temperature, the lossless check, the recommendation; the printed table and the PNG.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from eyas.core.run_paths import RunPaths
from eyas.eval.bench_settings import BenchSettings
from eyas.eval.engine_check import describe, sampled_decoding_check
from eyas.eval.offline_match import side_by_side
from eyas.eval.request_metrics import NOT_OFFERED
from eyas.export.vllm_command import vllm_serve_command

PLOT_NAME = RunPaths.BENCH_SERVE_PLOT
CONTEXT_PLOT_NAME = "bench_serve_by_context.png"


def point_key(drafter: str, k: int | None, temperature: float, concurrency: int, repeat: int = 0) -> str:
    return f"{drafter}|{k}|{temperature:g}|{concurrency}" + (f"|r{repeat}" if repeat else "")


def median_levels(points: list[dict]) -> list[dict]:
    """One point per level from its repeats: the repeat with the median output tokens/s
    (the lower of the two middle ones for an even count), so one run that the host's drift
    slowed or sped cannot decide a level, and every number of the kept point belongs to one
    run. `repeat_tok_s` lists every repeat's tokens/s, slowest first."""
    by_level: dict[str, list[dict]] = {}
    for p in points:
        by_level.setdefault(point_key(p["drafter"], p["k"], p["temperature"], p["concurrency"]), []).append(p)
    out = []
    for runs in by_level.values():
        runs = sorted(runs, key=lambda p: p["output_tok_s"])
        kept = dict(runs[(len(runs) - 1) // 2])
        kept.pop("repeat", None)
        kept["repeats"] = len(runs)
        kept["repeat_tok_s"] = [p["output_tok_s"] for p in runs]
        out.append(kept)
    return out


def target_summary(target: str) -> dict:
    """The target's sizes the planner needs (eval/sizes.py::target_size_from_config)."""
    cfg_path = Path(target) / "config.json"
    return json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}


def build_report(s: BenchSettings, points: list[dict], offline: list[dict] | None = None) -> dict:
    """Points (every repeat of every level) -> the report: one median point per level, the
    speedup table, the lossless check and the recommendation; with `offline` (eyas's τ on
    the same prompts, eval/offline_match.py), τ beside the engine's tokens per forward."""
    from eyas.eval.advice import advise

    points = median_levels(points)

    by_key = {point_key(p["drafter"], p["k"], p["temperature"], p["concurrency"]): p for p in points}
    spec_drafters = [d for d in s.drafters if d.kind != "plain"]
    speedup_by_t, lossless = {}, {}
    for t in s.temperatures:
        table = {}
        for d in spec_drafters:
            for k in s.ks:
                for c in s.concurrency:
                    plain = by_key.get(point_key("plain", None, t, c))
                    p = by_key.get(point_key(d.name, k, t, c))
                    if plain and p and plain["output_tok_s"] > 0:
                        table.setdefault(d.name, {}).setdefault(str(k), {})[str(c)] = (
                            p["output_tok_s"] / plain["output_tok_s"]
                        )
                    if t == 0 and plain and p:
                        same = sum(a == b for a, b in zip(p["output_sha1"], plain["output_sha1"]))
                        entry = lossless.setdefault(d.name, {}).setdefault(
                            str(k), {"identical": 0, "compared": 0}
                        )
                        entry["identical"] += same
                        entry["compared"] += len(plain["output_sha1"])
        speedup_by_t[f"{t:g}"] = table
    check = sampled_decoding_check(points, offline) if any(t > 0 for t in s.temperatures) else None
    untrusted = check is not None and check["passed"] is False
    for p in points:
        if untrusted and p["temperature"] > 0 and p["kind"] != "plain":
            p["unreliable"] = True
    trusted = [t for t in s.temperatures if t <= 0 or not untrusted]
    # the recommendation holds at the greedy temperature, else at the first one trusted
    greedy = f"{0.0:g}" if 0.0 in trusted else (f"{trusted[0]:g}" if trusted else None)
    # TAR per K at the lowest concurrency: the alarm judges each K on its own (it falls as K grows)
    tars = {}
    for d in spec_drafters:
        for k in s.ks:
            p = by_key.get(point_key(d.name, k, float(greedy), s.concurrency[0])) if greedy else None
            if p and p["tar"] is not None:
                tars.setdefault(d.name, {})[str(k)] = p["tar"]
    commands = {
        d.name: {str(k): vllm_serve_command(s.target, d.speculative_config(k)) for k in s.ks}
        for d in spec_drafters
    }
    recommendation = advise(speedup_by_t.get(greedy, {}), tars, commands)
    recommendation["temperature"] = float(greedy) if greedy is not None else None
    if untrusted:
        recommendation["warnings"].append(describe(check))
    return {
        "kind": "eyas bench-serve",
        "version": 1,
        "target": {"path": s.target, "config": target_summary(s.target), "dtype": s.dtype},
        "engine": {"python": s.vllm_python, "max_model_len": s.max_model_len, "engine_args": s.engine_args},
        "workload": {
            "source": s.workload,
            "prompts": len(s.prompts),
            "max_tokens": s.max_tokens,
            "repeats": s.repeats,
            "mean_prompt_tokens": statistics.fmean(len(p) for p in s.prompts) if s.prompts else 0,
        },
        "drafters": {d.name: asdict(d) for d in s.drafters},
        "ks": s.ks,
        "concurrency": s.concurrency,
        "temperatures": s.temperatures,
        "points": sorted(
            (dict((k, v) for k, v in p.items() if k not in ("fingerprint", "drafter_id")) for p in points),
            key=lambda p: (p["drafter"], p["k"] or 0, p["temperature"], p["concurrency"]),
        ),
        "speedup": speedup_by_t.get(greedy, {}),
        "speedup_temperature": float(greedy) if greedy is not None else None,
        "speedup_by_temperature": speedup_by_t,
        "lossless": lossless,
        "sampled_decoding_check": check,
        "per_request_metrics": per_request_status(points),
        "offline_vs_served": side_by_side(offline, points, s.concurrency[0]) if offline else None,
        "recommendation": recommendation,
    }


def per_request_status(points: list[dict]) -> str | None:
    """Whether the engine reported acceptance per request (eval/request_metrics.py)."""
    spec = [p for p in points if p["kind"] != "plain"]
    if not spec:
        return None
    return "recorded" if any(p.get("per_request") for p in spec) else NOT_OFFERED


# --- what a person reads ----------------------------------------------------------------


def format_report(report: dict) -> str:
    """Per temperature: output tok/s of plain and speedup of each drafter and K per concurrency."""
    conc = [str(c) for c in report["concurrency"]]
    lines = []
    for t in report["temperatures"]:
        pts = {
            (p["drafter"], p["k"], str(p["concurrency"])): p
            for p in report["points"]
            if p["temperature"] == t
        }
        rows = [
            ["drafter", "K", *[f"c={c}" for c in conc], "tok/fwd", "TAR", "accepted per position", "lossless"]
        ]
        plain = [pts.get(("plain", None, c)) for c in conc]
        rows.append(
            [
                "plain",
                "-",
                *[f"{p['output_tok_s']:.1f} t/s" if p else "-" for p in plain],
                "1.00",
                "-",
                "-",
                "-",
            ]
        )
        table = report["speedup_by_temperature"].get(f"{t:g}", {})
        for name, by_k in table.items():
            for k, by_c in by_k.items():
                first = pts.get((name, int(k), conc[0]))
                ll = report["lossless"].get(name, {}).get(k) if t == 0 else None
                rows.append(
                    [
                        name,
                        k,
                        *[f"{by_c[c]:.2f}x" if c in by_c else "-" for c in conc],
                        f"{first['tokens_per_forward']:.2f}" if first else "-",
                        f"{first['tar']:.0%}" if first and first["tar"] is not None else "-",
                        "/".join(f"{a:.0%}" for a in first.get("per_position_acceptance") or [])
                        if first
                        else "-",
                        f"{ll['identical']}/{ll['compared']}" if ll else "-",
                    ]
                )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append(
            f"temperature {t:g} (speedup = output tokens/s over plain at the same concurrency; "
            f"tok/fwd, TAR and acceptance per position at c={conc[0]})"
            + (" UNRELIABLE: the engine failed the sampled-decoding check" if unreliable(report, t) else "")
        )
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        lines.append("")
    from eyas.eval.advice import format_advice

    if report.get("sampled_decoding_check"):
        lines.append(describe(report["sampled_decoding_check"]))
    lines += per_request_lines(report)
    lines += offline_lines(report)
    rec_t = report["recommendation"].get("temperature")
    lines.append(
        f"(recommendation measured at temperature {rec_t:g})"
        if rec_t is not None
        else "(no trusted temperature)"
    )
    lines.append(format_advice(report["recommendation"]))
    return "\n".join(lines)


def offline_lines(report: dict) -> list[str]:
    """eyas's offline τ beside the engine's tokens per forward, per drafter, K, T and dtype."""
    rows = report.get("offline_vs_served")
    if not rows:
        return []
    c = report["concurrency"][0]
    lines = [f"offline tau (eyas, the same prompts and budget) vs served tokens per forward (c={c}):"]
    for e in rows:
        band = f" [{e['interval'][0]:.2f}, {e['interval'][1]:.2f}]" if e.get("interval") else ""
        served = e["served_tokens_per_forward"]
        lines.append(
            f"  {e['drafter']} K={e['k']} T={e['temperature']:g} {e['dtype']}: "
            f"tau {e['tau']:.2f}{band}, served "
            + (f"{served:.2f} ({served / e['tau'] - 1:+.1%})" if served else "-")
            + (" UNRELIABLE" if unreliable(report, e["temperature"]) else "")
        )
    return lines


def per_request_lines(report: dict) -> list[str]:
    """Accepted drafts per step by prompt length, per drafter and K at the lowest
    concurrency and the recommendation's temperature, or why there are none."""
    status = report.get("per_request_metrics")
    if status is None:
        return []
    if status != "recorded":
        return [f"per-request acceptance: {status}"]
    t, c = report["recommendation"].get("temperature"), report["concurrency"][0]
    if t is None:
        return ["per-request acceptance: recorded (no trusted temperature to show it at)"]
    lines = [f"per-request acceptance by prompt length (c={c}, temperature {t:g}; accepted drafts per step):"]
    for p in report["points"]:
        if p["temperature"] == t and p["concurrency"] == c and p.get("by_prompt_length"):
            groups = ", ".join(
                f"{g['prompt_tokens'][0]}-{g['prompt_tokens'][1]} tokens: {g['accepted_per_step']:.2f}"
                for g in p["by_prompt_length"]
                if g["accepted_per_step"] is not None
            )
            lines.append(f"  {p['drafter']} K={p['k']}: {groups}")
    lines += _context_lines(report, t, c)
    return lines


def _context_lines(report: dict, t, c) -> list[str]:
    """Tokens per forward and first-position acceptance per context bucket (each request
    in the bucket of its context halfway through its output), per drafter and K."""
    lines = []
    for p in report["points"]:
        if p["temperature"] == t and p["concurrency"] == c and p.get("by_context"):
            cells = []
            for label, g in p["by_context"].items():
                if g["accepted_per_step"] is None:
                    continue
                a1 = (g["per_position_acceptance"] or [None])[0]
                first = "" if a1 is None else f", a1 {a1:.0%}"
                cells.append(f"{label}: tau {1 + g['accepted_per_step']:.2f}{first} ({g['requests']} req)")
            lines.append(f"  {p['drafter']} K={p['k']}: " + "; ".join(cells))
    if lines:
        lines.insert(0, f"by context (prompt + half the output; c={c}, temperature {t:g}):")
    return lines


def unreliable(report: dict, temperature) -> bool:
    """Whether the engine failed the sampled-decoding check and `temperature` is sampled."""
    check = report.get("sampled_decoding_check") or {}
    return check.get("passed") is False and float(temperature) > 0


def repeat_spread(report: dict, drafter: str, k: str, temperature: str, concurrency: str):
    """(slowest, fastest) of a level's repeats as a speedup over plain's median run at the
    same concurrency and temperature; None without repeats of both."""

    def level(name, kk):
        return next(
            (
                p
                for p in report["points"]
                if p["drafter"] == name
                and (p["k"] is None if kk is None else str(p["k"]) == kk)
                and f"{p['temperature']:g}" == temperature
                and str(p["concurrency"]) == concurrency
            ),
            None,
        )

    p, plain = level(drafter, k), level("plain", None)
    if not (p and plain and len(p.get("repeat_tok_s") or []) > 1 and plain["output_tok_s"] > 0):
        return None
    return min(p["repeat_tok_s"]) / plain["output_tok_s"], max(p["repeat_tok_s"]) / plain["output_tok_s"]


def plot_speedup(report: dict, path: Path) -> None:
    """Speedup against concurrency, one panel per temperature, one line per drafter and K;
    with repeats, bars from the level's slowest to its fastest run (over plain's median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(report["speedup_by_temperature"])
    fig, axes = plt.subplots(1, len(temps), figsize=(6.0 * len(temps), 4.2), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, t in zip(axes[0], temps):
        table = report["speedup_by_temperature"][t]
        for i, (name, by_k) in enumerate(table.items()):
            for j, (k, by_c) in enumerate(by_k.items()):
                cs = sorted(by_c, key=int)
                ys = [by_c[c] for c in cs]
                spread = [repeat_spread(report, name, k, t, c) for c in cs]
                yerr = None
                if any(spread):
                    yerr = [
                        [y - s[0] if s else 0.0 for y, s in zip(ys, spread)],
                        [s[1] - y if s else 0.0 for y, s in zip(ys, spread)],
                    ]
                ax.errorbar(
                    [int(c) for c in cs],
                    ys,
                    yerr=yerr,
                    capsize=2 if yerr else 0,
                    marker="o",
                    color=f"C{i}",
                    ls=styles[j % len(styles)],
                    label=f"{name} K={k}",
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s over plain")
        bad = unreliable(report, t)
        if bad:
            for line in ax.get_lines():
                line.set_alpha(0.35)
        ax.set_title(
            f"temperature {t}" + ("\nUNRELIABLE: engine failed eyas's sampled-decoding check" if bad else "")
        )
        ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.suptitle(
        f"vLLM, {Path(report['target']['path']).name}, {report['workload']['source']} "
        f"({report['workload']['prompts']} prompts, {report['workload']['max_tokens']} tokens)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_served_by_context(report: dict, path: Path) -> Path | None:
    """τ per context bucket of each drafter and K at the lowest concurrency and the
    recommendation's temperature (the engine's per-request records, eval/context_buckets.py),
    drawn as `eyas eval` draws its own; None when the engine reported no per-request records."""
    from eyas.eval.context_buckets import plot_by_context

    t, c = report["recommendation"].get("temperature"), report["concurrency"][0]
    per_context = {
        f"{p['drafter']} K={p['k']}": {
            label: {
                "tau": 1 + g["accepted_per_step"],
                "per_position_acceptance": g["per_position_acceptance"],
            }
            for label, g in p["by_context"].items()
            if g["accepted_per_step"] is not None
        }
        for p in report["points"]
        if p["temperature"] == t and p["concurrency"] == c and p.get("by_context")
    }
    if not per_context:
        return None
    served = {"per_context": per_context, "workload": f"served, c={c}, T={t:g}", "k": max(report["ks"])}
    return plot_by_context(served, path)


def plot_report(report: dict, out_dir: Path) -> None:
    """The bench's PNGs: speedup (`PLOT_NAME`) and, where the engine reported per-request
    acceptance, τ by context (`CONTEXT_PLOT_NAME`)."""
    plot_speedup(report, out_dir / PLOT_NAME)
    plot_served_by_context(report, out_dir / CONTEXT_PLOT_NAME)
