"""Fit the planner's hardware terms to a measured `eyas bench-serve` report (DESIGN §6.3).

The planner's cost of an engine step (eval/planner.py) has five hardware terms: a fixed
overhead per step, one per forward pass, a latency per decoder layer, an effective memory
bandwidth and an effective FLOP rate. Each measured level gives output tokens/s at a batch
(the mean number of requests in flight) and a context; speculative levels also give the
measured tokens per target forward and the draft tokens the engine verified per step, so
only the cost model is fitted, never the acceptance or how often an n-gram drafter
matched. Each step also carries its share of the prompts' prefill (the engine mixes it
into decode steps). The fit minimises the squared log error of tokens/s over the fit
points; held-out points (concurrencies or K values left out) are predicted, and the
speedup error there says how far to trust the planner at points nobody measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from eyas.eval.planner import draft_time, step_time
from eyas.eval.sizes import Hardware, HeadSize, TargetSize, head_size, target_size_from_config
from eyas.heads.algorithms import get_algorithm

PARAMS = ("step_overhead", "pass_overhead", "layer_latency", "hbm_bandwidth", "peak_flops")
# Where the fit searches (log space, so Nelder-Mead cannot step to an overflow): from 0.1 us
# to 1 s per step, pass or layer, 0.1 GB/s to 100 TB/s, 1 GFLOP/s to 10 PFLOP/s.
BOUNDS = ((1e-7, 1.0), (1e-7, 1.0), (1e-8, 1.0), (1e8, 1e14), (1e9, 1e16))


class CalibrationError(ValueError):
    """A bench report the fit cannot use; the message names what is missing."""


@dataclass
class Calibration:
    hardware: Hardware
    target: TargetSize
    fit_points: list[dict] = field(default_factory=list)
    heldout_points: list[dict] = field(default_factory=list)
    max_fit_error: float = 0.0
    max_heldout_error: float | None = None  # |predicted / measured speedup - 1| over held-out points

    def as_dict(self) -> dict:
        return {
            "hardware": asdict(self.hardware),
            "target": asdict(self.target),
            "fit_points": self.fit_points,
            "heldout_points": self.heldout_points,
            "max_fit_error": self.max_fit_error,
            "max_heldout_error": self.max_heldout_error,
        }


def _heads(report: dict, target: TargetSize) -> dict[str, HeadSize]:
    out = {}
    for name, d in report["drafters"].items():
        if d["kind"] == "ngram":
            out[name] = HeadSize("ngram", 0, 0.0, 0.0)
        elif d["kind"] == "head":
            out[name] = head_size(
                target,
                d.get("algorithm") or "eagle3",
                d.get("num_layers"),
                d.get("draft_vocab") or target.vocab_size,
            )
    return out


def predicted_tok_s(
    hw: Hardware, target: TargetSize, head: HeadSize | None, point: dict, workload: dict | None = None
) -> float:
    """Output tokens/s the planner's cost model gives for one measured level: its batch,
    context, tokens per forward and draft tokens per step as measured, and the prompts'
    prefill spread over each request's steps (`workload`: mean_prompt_tokens, max_tokens)."""
    b, ctx = max(point["mean_in_flight"], 1e-3), int(point["mean_context"])
    e = point.get("tokens_per_forward") or 1.0
    steps = point["output_tokens"] / e if point.get("output_tokens") else 0.0
    workload = workload or {}
    prefill = (
        workload["mean_prompt_tokens"] * e / workload["max_tokens"]
        if workload.get("mean_prompt_tokens") and workload.get("max_tokens")
        else 0.0
    )
    if head is None:
        return b * e / step_time(hw, target, None, b, ctx, prefill=prefill)
    # steps of the whole level, each verifying its sequences' drafts: per sequence per step
    drafted = point["draft_tokens"] / steps if steps and point.get("draft_tokens") is not None else None
    step = step_time(hw, target, head, b, ctx, k=point["k"], drafted=drafted, prefill=prefill)
    return b * e / step


def _hardware(x, name: str) -> Hardware:
    values = dict(zip(PARAMS, (math.exp(v) for v in x)))
    return Hardware(
        name,
        values["hbm_bandwidth"],
        values["peak_flops"],
        values["layer_latency"],
        values["pass_overhead"],
        bw_efficiency=1.0,
        flops_efficiency=1.0,
        step_overhead=values["step_overhead"],
    )


def calibrate(report: dict, holdout_concurrency=(), holdout_k=(), name: str = "measured") -> Calibration:
    """Fit on the greedy levels outside the held-out concurrencies and K values."""
    from scipy.optimize import minimize

    cfg = report.get("target", {}).get("config") or {}
    if "hidden_size" not in cfg:
        raise CalibrationError(
            "the bench report carries no target config.json (target.config); run a newer `eyas bench-serve`"
        )
    dtype = report["target"].get("dtype", "bfloat16")
    target = target_size_from_config(
        cfg,
        name=cfg.get("_name_or_path", "target").split("/")[-1],
        bytes_per_param=4.0 if dtype == "float32" else 2.0,
    )
    heads = _heads(report, target)
    temp = report.get("speedup_temperature", 0.0)
    points = [p for p in report["points"] if p["temperature"] == temp and p["output_tok_s"] > 0]
    plain = {p["concurrency"]: p for p in points if p["kind"] == "plain"}
    held = lambda p: p["concurrency"] in holdout_concurrency or (p["k"] in holdout_k)  # noqa: E731
    fit = [p for p in points if not held(p)]
    if not any(p["kind"] == "plain" for p in fit) or not any(p["kind"] != "plain" for p in fit):
        raise CalibrationError("the fit needs plain and speculative levels outside the held-out ones")

    workload = report.get("workload") or {}

    def predict(hw: Hardware, p: dict) -> float:
        return predicted_tok_s(hw, target, heads.get(p["drafter"]), p, workload)

    def loss(x) -> float:
        hw = _hardware(x, name)
        return sum((math.log(predict(hw, p)) - math.log(p["output_tok_s"])) ** 2 for p in fit)

    # starts around a host without an accelerator: 1-10 ms per step, 0.1-1 ms per pass,
    # 0.1 ms per layer, 5-50 GB/s, 100 GFLOP/s
    starts = [
        [math.log(v) for v in (so, po, 1e-4, bw, 1e11)]
        for so in (1e-3, 1e-2)
        for po in (1e-4, 1e-3)
        for bw in (5e9, 5e10)
    ]
    bounds = [(math.log(lo), math.log(hi)) for lo, hi in BOUNDS]
    best = min(
        (
            minimize(
                loss,
                x0,
                method="Nelder-Mead",
                bounds=bounds,
                options={"maxiter": 8000, "xatol": 1e-5, "fatol": 1e-12},
            )
            for x0 in starts
        ),
        key=lambda r: r.fun,
    )
    hw = _hardware(best.x, name)
    cal = Calibration(hw, target)
    for p in points:
        pred = predict(hw, p)
        row = {
            "drafter": p["drafter"],
            "k": p["k"],
            "concurrency": p["concurrency"],
            "measured_tok_s": p["output_tok_s"],
            "predicted_tok_s": pred,
            "tok_s_error": pred / p["output_tok_s"] - 1,
        }
        base = plain.get(p["concurrency"])
        if p["kind"] != "plain" and base:
            meas = p["output_tok_s"] / base["output_tok_s"]
            guess = pred / predict(hw, base)
            row.update(measured_speedup=meas, predicted_speedup=guess, speedup_error=guess / meas - 1)
        (cal.heldout_points if held(p) else cal.fit_points).append(row)
    cal.max_fit_error = max(abs(r["tok_s_error"]) for r in cal.fit_points)
    errs = [abs(r["speedup_error"]) for r in cal.heldout_points if "speedup_error" in r]
    cal.max_heldout_error = max(errs) if errs else None
    return cal


def draft_terms_from_chains(hw: Hardware, chains: dict[HeadSize, float], batch: int, context: int) -> dict:
    """A draft head's fixed terms (`draft_pass_overhead`, `draft_layer_latency`, seconds)
    from measured EAGLE-3 chains (scripts/bench_draft.py): `chains` maps each chain's size
    to the seconds one more draft pass adds at `batch` sequences of `context` tokens. What
    the roofline explains of a pass (its weights and KV read, its FLOPs) is taken off; two
    chains of different depth split the rest into a per-pass and a per-layer part, one
    chain keeps `hw`'s layer latency and fits the pass overhead alone. Neither is negative."""
    if not chains or any(get_algorithm(h.algorithm).draft_passes(2) != 2 for h in chains):
        raise CalibrationError("the draft terms are fitted to EAGLE-3 chains (one pass per drafted token)")
    bare = replace(hw, draft_pass_overhead=0.0, draft_layer_latency=0.0)
    # one chained pass: a one-token pass per sequence, nothing but the roofline on `bare`
    fixed = {h: sec - draft_time(bare, h, batch, 1, context, drafted=0) for h, sec in chains.items()}
    shallow, deep = min(fixed, key=lambda h: h.num_layers), max(fixed, key=lambda h: h.num_layers)
    if deep.num_layers > shallow.num_layers:
        layer = max(0.0, (fixed[deep] - fixed[shallow]) / (deep.num_layers - shallow.num_layers))
    else:
        layer = hw.layer_latency if hw.draft_layer_latency is None else hw.draft_layer_latency
    return {
        "draft_pass_overhead": max(0.0, fixed[shallow] - shallow.num_layers * layer),
        "draft_layer_latency": layer,
    }


def default_holdout(report: dict) -> list[int]:
    """Every second interior concurrency: the fit keeps both ends and interpolates these."""
    return sorted(report["concurrency"])[1:-1][::2]


def format_calibration(cal: Calibration) -> str:
    hw = cal.hardware
    lines = [
        f"fitted {hw.name}: {hw.step_overhead * 1e3:.2f} ms/step + {hw.pass_overhead * 1e3:.2f} ms/pass "
        f"+ {hw.layer_latency * 1e6:.0f} us/layer, "
        f"{hw.hbm_bandwidth / 1e9:.1f} GB/s, {hw.peak_flops / 1e9:.0f} GFLOP/s (effective)",
        f"{'':4}{'drafter':>10} {'K':>3} {'conc':>5} {'meas t/s':>9} {'pred t/s':>9} {'meas x':>7} "
        f"{'pred x':>7} {'err':>6}",
    ]
    for tag, rows in (("fit", cal.fit_points), ("held", cal.heldout_points)):
        for r in rows:
            sp = (
                f"{r['measured_speedup']:7.2f} {r['predicted_speedup']:7.2f} {r['speedup_error']:+6.0%}"
                if "speedup_error" in r
                else f"{'':7} {'':7} {r['tok_s_error']:+6.0%}"
            )
            lines.append(
                f"{tag:4}{r['drafter']:>10} {r['k'] or '-':>3} {r['concurrency']:>5} "
                f"{r['measured_tok_s']:9.1f} "
                f"{r['predicted_tok_s']:9.1f} {sp}"
            )
    lines.append(
        f"max fit error (tok/s) {cal.max_fit_error:.1%}; max held-out speedup error "
        + (f"{cal.max_heldout_error:.1%}" if cal.max_heldout_error is not None else "n/a (nothing held out)")
    )
    return "\n".join(lines)
