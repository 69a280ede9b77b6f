"""eyas plan: which K to serve, and the concurrency above which speculation stops paying.

From the measured per-position acceptance (an `eyas eval` report, or --acceptance) and a
roofline of the target on the chosen hardware, prints the expected speedup against
concurrency for K = 1..max-k, the best K per concurrency, the break-even concurrency and
the `--speculative-config` JSON for vLLM; writes a PNG. Every input and assumption is
printed.

  eyas plan --report runs/x/eval/eval_report.json --hardware H200 --target-params llama-3.1-8b
  eyas plan --acceptance 0.8,0.75,0.7 --hardware B200 --target-params gpt-oss-20b --compare
  eyas plan --calibrate runs/x/bench_serve/bench_serve.json      # fit the hardware terms to a measurement
  eyas plan --hardware runs/x/bench_serve/hardware-calibrated.json --target-params smollm2-135m \
      --acceptance ...

With --calibrate, the planner's hardware terms are fitted to an `eyas bench-serve`
report: the fit error per point, the prediction of held-out points (every second interior
concurrency unless --holdout-concurrency / --holdout-k say otherwise) and the saved profile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eyas.eval.sizes import HARDWARE, TARGETS
    from eyas.heads.algorithms import algorithm_names

    add_recipe_arguments(parser)
    parser.add_argument(
        "--report", help="eval_report.json from `eyas eval` (default: run_dir/eval/eval_report.json)"
    )
    parser.add_argument("--acceptance", help="per-position acceptance a_1,a_2,... instead of a report")
    parser.add_argument(
        "--hardware",
        default="H200",
        help=f"one of {', '.join(HARDWARE)}, or a JSON profile written by --calibrate",
    )
    parser.add_argument(
        "--calibrate", metavar="BENCH.json", help="fit the hardware terms to an `eyas bench-serve` report"
    )
    parser.add_argument(
        "--holdout-concurrency", help="with --calibrate: concurrencies left out of the fit (comma list)"
    )
    parser.add_argument("--holdout-k", help="with --calibrate: K values left out of the fit (comma list)")
    parser.add_argument(
        "--save-hardware", help="with --calibrate: where the profile goes (default: next to the report)"
    )
    parser.add_argument(
        "--target-params",
        help=f"one of {', '.join(TARGETS)}, or key=value sizes (total_params=8e9,num_layers=32,...)",
    )
    parser.add_argument("--algorithm", choices=algorithm_names(), help="default: the report's head")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="plan EAGLE-3 (K chained passes) and P-EAGLE (one pass) side by side",
    )
    parser.add_argument(
        "--head-layers", type=int, help="draft head layers (default: 1 for EAGLE-3, 4 for P-EAGLE)"
    )
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=2048, help="mean tokens in each sequence's KV cache")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--concurrency", help="comma list (default 1,2,4,...,512)")
    parser.add_argument(
        "--serve-concurrency", type=int, default=1, help="the concurrency the printed config is for"
    )
    parser.add_argument("--layer-latency-us", type=float, help="override the per-layer latency floor")
    parser.add_argument("--pass-overhead-us", type=float, help="override the per-pass fixed overhead")
    parser.add_argument("--out", help="PNG/JSON directory (default: run_dir/eval)")
    parser.add_argument("--json", action="store_true")


def _acceptance(args, recipe) -> tuple[list[float], str | None, str, str | None]:
    """(per-position acceptance, algorithm, where it came from, the evaluated head's dir)."""
    if args.acceptance:
        try:
            rates = [float(x) for x in args.acceptance.split(",")]
        except ValueError:
            raise CommandError(f"--acceptance {args.acceptance!r}: expected numbers a1,a2,...") from None
        return _checked_rates(rates, "--acceptance"), None, "--acceptance", None
    path = Path(args.report) if args.report else recipe.paths.eval_report
    if not path.is_file():
        raise CommandError(f"no report at {path}; run `eyas eval` or pass --acceptance a1,a2,...")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CommandError(f"{path} is not a JSON eval report ({err}); run `eyas eval` again") from None
    head = report.get("drafters", {}).get("head") if isinstance(report, dict) else None
    if not head or not head.get("per_position_acceptance"):
        raise CommandError(f"{path} holds no head acceptance (was eval run without --head?)")
    rates = [r for r in head["per_position_acceptance"] if r is not None]
    return _checked_rates(rates, str(path)), report.get("algorithm"), str(path), report.get("head")


def _checked_rates(rates: list, source: str) -> list[float]:
    """Acceptance rates are probabilities: anything outside [0, 1] is a typo or a damaged report."""
    bad = [r for r in rates if not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0]
    if bad or not rates:
        raise CommandError(f"{source}: per-position acceptances must be numbers in [0, 1], got {rates}")
    return [float(r) for r in rates]


def _check_flags(args) -> list[int]:
    """The numeric flags in range (a CommandError naming the flag); returns the concurrencies."""
    from eyas.recipe import MAX_K

    for flag, value, low in (
        ("--max-k", args.max_k, 1),
        ("--context", args.context, 1),
        ("--draft-vocab", args.draft_vocab, 1),
        ("--head-layers", args.head_layers, 1),
        ("--serve-concurrency", args.serve_concurrency, 1),
    ):
        if value is not None and value < low:
            raise CommandError(f"{flag} must be at least {low}, got {value}")
    if args.max_k > MAX_K:
        raise CommandError(f"--max-k must be at most {MAX_K}, got {args.max_k}")
    if not args.concurrency:
        return []
    try:
        conc = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise CommandError(f"--concurrency {args.concurrency!r}: expected whole numbers b1,b2,...") from None
    if any(c < 1 for c in conc):
        raise CommandError(f"--concurrency values must be at least 1, got {args.concurrency}")
    return conc


def _ints(flag: str, text) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"{flag} {text!r}: expected whole numbers a,b,...") from None


def run_calibrate(args: argparse.Namespace) -> int:
    from eyas.eval import calibrate as C

    path = Path(args.calibrate)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CommandError(f"--calibrate {path}: not a readable bench-serve report ({err})") from None
    if not isinstance(report, dict) or report.get("kind") != "eyas bench-serve":
        raise CommandError(f"--calibrate {path}: not an `eyas bench-serve` report")
    held_k = _ints("--holdout-k", args.holdout_k)
    held_c = _ints("--holdout-concurrency", args.holdout_concurrency)
    if not held_c and not held_k:
        held_c = C.default_holdout(report)
    try:
        cal = C.calibrate(report, held_c, held_k, name=f"calibrated:{path.parent.name}")
    except C.CalibrationError as err:
        raise CommandError(f"--calibrate {path}: {err}") from None
    out = Path(args.save_hardware) if args.save_hardware else path.parent / "hardware-calibrated.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = cal.as_dict()
    out.write_text(
        json.dumps(
            {
                "hardware": body["hardware"],
                "calibrated_from": str(path),
                "target": body["target"],
                "max_heldout_error": cal.max_heldout_error,
            },
            indent=2,
        )
        + "\n"
    )
    if args.json:
        print(json.dumps({**body, "profile": str(out), "holdout_concurrency": held_c, "holdout_k": held_k}))
        return 0
    print(f"calibrating on {path} (held out: concurrency {held_c or '-'}, K {held_k or '-'})")
    print(C.format_calibration(cal))
    print(f"saved the profile to {out}; use it with --hardware {out}")
    return 0


def _why_not_speculate(p, serve_at: int) -> str | None:
    """'do not speculate' with why, when no K is predicted to beat plain decoding at the
    concurrency served; None when one does."""
    k = p.best_k[serve_at]
    if p.speedup[serve_at][k] > 1.0:
        return None
    best_c = max(p.concurrency, key=lambda b: p.speedup[b][p.best_k[b]])
    elsewhere = (
        " nor at any other concurrency planned"
        if p.speedup[best_c][p.best_k[best_c]] <= 1.0
        else f"; concurrency {best_c} would pay ({p.speedup[best_c][p.best_k[best_c]]:.2f}x)"
    )
    return (
        f"do not speculate at concurrency {serve_at}: no K pays there (the best, K={k}, gives "
        f"{p.speedup[serve_at][k]:.2f}x){elsewhere}; with first-position acceptance {p.acceptance[0]:.2f} "
        f"the tokens accepted per step do not cover drafting K and verifying K+1 tokens"
    )


def run(args: argparse.Namespace) -> int:
    from eyas.core.run_paths import RunPaths
    from eyas.eval import planner as P
    from eyas.eval import sizes as S

    if args.calibrate:
        return run_calibrate(args)
    if not args.target_params:
        raise CommandError("--target-params is required (a name or key=value sizes), unless --calibrate")
    given_conc = _check_flags(args)
    recipe = load_recipe_from_args(args)
    rates, report_alg, source, head_dir = _acceptance(args, recipe)
    try:
        base_hw = S.load_hardware(args.hardware)
    except ValueError as err:
        raise CommandError(f"{err}") from None
    hw = S.with_overrides(
        base_hw,
        layer_latency=args.layer_latency_us * 1e-6 if args.layer_latency_us is not None else None,
        pass_overhead=args.pass_overhead_us * 1e-6 if args.pass_overhead_us is not None else None,
    )
    try:
        target = S.parse_target(args.target_params)
    except ValueError as err:
        raise CommandError(f"{err}") from None
    conc = given_conc or list(P.CONCURRENCY)
    algorithms = ["eagle3", "peagle"] if args.compare else [args.algorithm or report_alg or "eagle3"]
    plans = {}
    for alg in algorithms:
        layers = args.head_layers if len(algorithms) == 1 else None
        head = S.head_size(target, alg, layers, args.draft_vocab, recipe.head.sliding_window)
        plans[alg] = P.plan(rates, hw, target, head, args.context, conc, args.max_k)
    out = Path(args.out) if args.out else recipe.paths.eval
    out.mkdir(parents=True, exist_ok=True)
    P.plot_plans(plans, out / RunPaths.PLAN_PLOT)
    (out / RunPaths.PLAN).write_text(P.dumps(plans) + "\n")
    serve_at = args.serve_concurrency if args.serve_concurrency in conc else conc[0]
    model = head_dir or str(recipe.paths.export)  # the head the report measured
    # A plan whose best K does not pay at the concurrency served recommends no drafter.
    why_not = {alg: reason for alg, p in plans.items() if (reason := _why_not_speculate(p, serve_at))}
    best = {alg: P.speculative_config(p, serve_at, model) for alg, p in plans.items()}
    configs = {alg: None if alg in why_not else config for alg, config in best.items()}
    from eyas.core.acceptance import expected_tokens_per_step
    from eyas.eval.advice import advise, format_advice
    from eyas.export.vllm_command import vllm_serve_command

    table = {
        alg: {str(k): {str(b): p.speedup[b][k] for b in p.concurrency} for k in p.ks}
        for alg, p in plans.items()
    }
    commands = {
        alg: {
            str(k): vllm_serve_command("<target>", {**best[alg], "num_speculative_tokens": k}) for k in p.ks
        }
        for alg, p in plans.items()
    }
    # TAR at the K served at the lowest concurrency: (E_K - 1) / K
    tars = {
        alg: (expected_tokens_per_step(p.acceptance[: p.best_k[conc[0]]]) - 1) / p.best_k[conc[0]]
        for alg, p in plans.items()
    }
    advice = advise(table, tars, commands)
    if args.json:
        body = json.loads(P.dumps(plans))
        print(
            json.dumps(
                {
                    "acceptance_source": source,
                    "plans": body,
                    "speculative_config": configs,
                    "do_not_speculate": why_not,
                    "recommendation": advice,
                },
                indent=2,
            )
        )
        return 0
    print(f"inputs: acceptance from {source}")
    for alg, p in plans.items():
        print(f"\n== {alg} ==")
        for line in P.assumptions(p):
            print("  " + line)
        print(P.format_plan(p))
        if alg in why_not:
            print(why_not[alg])
        else:
            print(f"--speculative-config '{json.dumps(configs[alg])}'   (best K at concurrency {serve_at})")
    if len(plans) == 2:
        pe, e3 = plans["peagle"], plans["eagle3"]
        ratio = ", ".join(
            f"{b}: {pe.speedup[b][pe.best_k[b]] / e3.speedup[b][e3.best_k[b]]:.2f}x" for b in conc
        )
        same = ", ".join(
            f"{b}: {pe.speedup[b][args.max_k - 1] / e3.speedup[b][args.max_k - 1]:.2f}x" for b in conc
        )
        print(f"\nP-EAGLE over EAGLE-3 (best K each, same acceptance): {ratio}")
        print(f"P-EAGLE over EAGLE-3 at K={args.max_k - 1} (same acceptance): {same}")
    print("\n" + format_advice(advice))
    print(f"wrote {out / 'plan.png'}, {out / 'plan.json'}", file=sys.stderr)
    return 0
