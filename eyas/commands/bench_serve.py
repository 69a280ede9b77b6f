"""eyas bench-serve: the speed a head really gives, measured in vLLM (DESIGN §6.2).

Serves the target plain, with vLLM's n-gram drafter and with each head, at each K, and
sends the workload's first turns at each concurrency and temperature. Records output
tokens/s, per-request tokens/s, time per output token, time to first token, acceptance
per position, TAR and tokens per target forward; checks at temperature 0 that every
drafter's outputs equal plain decoding's; writes bench_serve.json, points.jsonl (a killed
bench resumes from it) and bench_serve.png, and prints the table and a recommendation.

  eyas bench-serve -r recipes/smollm2-135m-eagle3.yaml            # the quickstart head, plain, n-gram
  eyas bench-serve --head e3=runs/a/export --head pe=runs/b/export --k 3,5 --concurrency 1,8
  eyas bench-serve --vllm-python /opt/vllm/bin/python --target org/model --head org/head --json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, progress=True)
    parser.add_argument(
        "--target", help="target model directory or Hub id (default: recipe target.name_or_path)"
    )
    parser.add_argument(
        "--head",
        action="append",
        default=[],
        metavar="[NAME=]HEAD",
        help="a head directory or Hub id to serve (repeatable; default: run_dir/export when it exists)",
    )
    parser.add_argument("--no-ngram", action="store_true", help="leave vLLM's n-gram drafter out")
    parser.add_argument(
        "--workload", help="mtbench, a .json/.jsonl file or a dataset (default: eval.workload)"
    )
    parser.add_argument("--max-prompts", type=int, help="evenly spaced subset of the workload's first turns")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    _add_numbers(parser, "--k", "3,5,7", "draft tokens per step")
    _add_numbers(parser, "--concurrency", "1,2,4,8,16,32", "requests in flight")
    _add_numbers(parser, "--temperatures", "0,0.7", "temperatures (0 is greedy and checks losslessness)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each level on its engine; the report keeps the median run (a drifting host)",
    )
    parser.add_argument(
        "--offline-eval",
        action="store_true",
        help="also decode the same prompts with eyas's offline eval (float32 and --dtype) and set its "
        "tau beside the engine's tokens per forward",
    )
    parser.add_argument(
        "--vllm-python",
        help="the Python of the vLLM install (default: .venv-vllm/bin/python "
        "when it exists, else this interpreter)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--port", type=int, default=18300, help="127.0.0.1 port of the engine")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `vllm serve` (repeatable, e.g. --engine-arg=--enforce-eager)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=1800.0, help="seconds an engine may take to start"
    )
    parser.add_argument("--ngram-min", type=int, help="default: eval.ngram_min")
    parser.add_argument("--ngram-max", type=int, help="default: eval.ngram_max")
    parser.add_argument("--out", help="output directory (default: run_dir/bench_serve)")
    parser.add_argument("--fresh", action="store_true", help="measure every level again instead of resuming")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")


def _add_numbers(parser: argparse.ArgumentParser, flag: str, default: str, what: str) -> None:
    """A flag taking a comma list of numbers, which `_numbers` reads."""
    parser.add_argument(flag, default=default, help=f"{what}, comma list")


def _numbers(flag: str, text: str, cast=int, low: float = 1) -> list:
    """A comma list of numbers, each at least `low` (a CommandError naming the flag)."""
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"{flag} {text!r}: expected numbers a,b,...") from None
    if not values or any(v < low for v in values):
        raise CommandError(f"{flag} values must be at least {low}, got {text!r}")
    return values


def _heads(specs: list[str], default_export: Path) -> list[tuple[str, str]]:
    if not specs:
        return [("head", str(default_export))] if (default_export / "config.json").is_file() else []
    out, seen = [], {"plain", "ngram"}
    for i, spec in enumerate(specs):
        name, sep, head = spec.partition("=")
        if not sep or "/" in name or not name:
            name, head = ("head" if i == 0 else f"head{i + 1}"), spec
        if name in seen:
            raise CommandError(f"--head name {name!r} is used twice or names a built-in drafter")
        seen.add(name)
        out.append((name, head))
    return out


def first_turn_prompts(
    target: str, workload: str, max_prompts, trust_remote_code: bool = False
) -> list[list[int]]:
    """The workload's first user turns, rendered with the target's chat template."""
    from eyas.eval.workloads import load_workload, render_turn
    from eyas.target.load import load_tokenizer

    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    return [render_turn(tokenizer, p, []) for p in load_workload(workload, max_prompts)]


def run(args: argparse.Namespace) -> int:
    from eyas.core.engine_process import EngineError
    from eyas.eval import bench_serve as B
    from eyas.eval.bench_settings import BenchSettings, Drafter, head_drafter
    from eyas.eval.workloads import WorkloadError
    from eyas.export.fetch import fetch_head
    from eyas.export.validate import ExportFormatError
    from eyas.target.load import resolve_target_path

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    ks = _numbers("--k", args.k)
    conc = _numbers("--concurrency", args.concurrency)
    temps = _numbers("--temperatures", args.temperatures, float, 0)
    if args.repeats < 1:
        raise CommandError(f"--repeats must be at least 1, got {args.repeats}")
    recipe = load_recipe_from_args(args)
    ev = recipe.eval
    target = resolve_target_path(args.target or recipe.target.name_or_path)
    drafters = [Drafter("plain", "plain")]
    if not args.no_ngram:
        drafters.append(
            Drafter(
                "ngram",
                "ngram",
                ngram_min=args.ngram_min or ev.ngram_min,
                ngram_max=args.ngram_max or ev.ngram_max,
            )
        )
    try:
        for name, spec in _heads(args.head, recipe.paths.export):
            drafters.append(head_drafter(name, str(fetch_head(spec))))
        prompts = first_turn_prompts(
            target, args.workload or ev.workload, args.max_prompts, recipe.target.trust_remote_code
        )
    except (B.BenchError, ExportFormatError, WorkloadError) as err:
        raise CommandError(f"{err}") from None
    from eyas.core.engine_process import repo_vllm_python

    python = args.vllm_python or str(repo_vllm_python() or sys.executable)
    settings = BenchSettings(
        target=target,
        drafters=drafters,
        prompts=prompts,
        workload=args.workload or ev.workload,
        ks=ks,
        concurrency=conc,
        temperatures=temps,
        max_tokens=args.max_tokens,
        vllm_python=python,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        port=args.port,
        engine_args=list(args.engine_arg),
        startup_timeout_s=args.startup_timeout,
        repeats=args.repeats,
        offline_eval=args.offline_eval,
    )
    out = Path(args.out) if args.out else recipe.paths.bench_serve
    if args.fresh:
        (out / B.POINTS_NAME).unlink(missing_ok=True)
    try:
        report = B.run_bench(settings, out, progress=not args.no_progress)
    except (B.BenchError, EngineError) as err:
        raise CommandError(f"{err}") from None
    if args.json:
        print(json.dumps(report))
    else:
        print(B.format_report(report))
    print(f"wrote {out / B.REPORT_NAME}, {out / B.PLOT_NAME}", file=sys.stderr)
    lossy = [
        f"{name} K={k}: {v['compared'] - v['identical']} of {v['compared']}"
        for name, by_k in report["lossless"].items()
        for k, v in by_k.items()
        if v["identical"] != v["compared"]
    ]
    if lossy:
        print(
            "greedy outputs that differ from plain decoding: "
            + ", ".join(lossy)
            + (
                " (in bf16 a K+1-token verify pass rounds unlike a one-token pass; --dtype float32 is exact)"
                if report.get("dtype", report.get("target", {}).get("dtype")) != "float32"
                else ""
            ),
            file=sys.stderr,
        )
    return 0
