"""eyas eval: offline speculative decoding of a trained head (and the prompt-lookup
baseline) against the target on held-out prompts.

Reports tau (tokens per target forward), per-position acceptance, TAR, tokens/s of
speculative vs plain greedy decoding measured on this machine, and checks that greedy
speculative output equals plain greedy output token for token (exit 1 when it does not).
Each decoded prompt is logged (eval_sequences.jsonl beside the report): a killed eval, run
again with the same arguments, decodes only the prompts it had not finished.

  eyas eval --target smollm2-135m --head runs/x/export --workload mtbench --k 5 --max-prompts 8
  eyas eval --recipe recipes/smollm2-135m-eagle3.yaml        # defaults: eval section, run_dir/export
  eyas eval --target smollm2-135m --baseline ngram      # no head: the baseline only
  eyas eval -r R --head runs/tuned/export --compare before=runs/base/export   # one report, both heads
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, progress=True)
    parser.add_argument("--target", help="target model (default: recipe target.name_or_path)")
    parser.add_argument(
        "--head",
        help="head: an eyas checkpoint, an export or a published head, as a directory or a "
        "Hub id (default: run_dir/export when it exists)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="[NAME=]HEAD",
        help="another head decoded on the same prompts, reported beside --head (repeatable; "
        "NAME labels it in the table and plot, default compare, compare2, ...)",
    )
    parser.add_argument(
        "--workload",
        help="mtbench, a .json/.jsonl of prompts or conversations, or a dataset (default: eval.workload)",
    )
    parser.add_argument("--k", type=int, help="draft tokens per step (default: eval.k)")
    parser.add_argument("--max-prompts", type=int, help="evenly spaced subset of the workload")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float, help="0: greedy (default); > 0: rejection sampling")
    parser.add_argument(
        "--sampler",
        choices=["vllm", "exact"],
        help="at temperature > 0: vllm drafts and accepts as vLLM does (default), exact samples drafts "
        "and accepts with min(1, p/q)",
    )
    parser.add_argument(
        "--draft-sample-method",
        choices=["greedy", "probabilistic"],
        help="vLLM's draft_sample_method the vllm sampler follows (default greedy)",
    )
    parser.add_argument("--top-k", type=int, help="the target's top-k at temperature > 0 (0: off)")
    parser.add_argument("--top-p", type=float, help="the target's top-p at temperature > 0 (1: off)")
    parser.add_argument(
        "--baseline", choices=["ngram", "none"], help="prompt-lookup baseline (default: eval.baseline)"
    )
    parser.add_argument("--ngram-min", type=int)
    parser.add_argument("--ngram-max", type=int)
    parser.add_argument(
        "--decode-baseline",
        action="store_true",
        default=None,
        help="decode the baseline against the target to measure its tok/s (default under greedy: "
        "replay it over the plain greedy tokens, the same tau and acceptance)",
    )
    parser.add_argument(
        "--decoded-prompts",
        type=int,
        help="under greedy, decode only this many prompts (evenly spaced) against the target, for "
        "tok/s and the lossless check; replay every drafter over the plain tokens on the rest, the "
        "same acceptance (default: eval.decoded_prompts, else all)",
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="the target's dtype while evaluating (default: eval.dtype, else target.dtype)",
    )
    parser.add_argument("--out", help="output directory (default: run_dir/eval)")
    parser.add_argument(
        "--tie-tolerance",
        type=float,
        help="top-2 logit margin under which a greedy mismatch counts as a numerical near-tie",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


# The command-line flags that set an eval recipe key of the same name.
EVAL_FLAGS = (
    "workload", "k", "max_prompts", "max_new_tokens", "temperature", "baseline",
    "ngram_min", "ngram_max", "decode_baseline", "decoded_prompts", "seed", "dtype",
    "sampler", "draft_sample_method", "top_k", "top_p",
)  # fmt: skip


def eval_recipe(recipe, args: argparse.Namespace):
    """The recipe with the command line's flags applied to its eval (and target) section,
    validated as the recipe's own values are."""
    from pydantic import ValidationError

    from eyas.eval.evaluate import EvalError

    updates = {key: getattr(args, key) for key in EVAL_FLAGS if getattr(args, key) is not None}
    if updates.get("baseline") == "none":
        updates["baseline"] = None
    try:
        section = type(recipe.eval).model_validate({**recipe.eval.model_dump(), **updates})
    except ValidationError as err:
        first = err.errors()[0]
        raise EvalError(f"--{'-'.join(map(str, first['loc'])).replace('_', '-')}: {first['msg']}") from None
    changed = {"eval": section}
    if args.target:
        changed["target"] = recipe.target.model_copy(update={"name_or_path": args.target})
    return recipe.model_copy(update=changed)


def run(args: argparse.Namespace) -> int:
    from eyas.eval.evaluate import compare_heads, evaluate
    from eyas.eval.report import format_report

    recipe = eval_recipe(load_recipe_from_args(args), args)
    report, paths = evaluate(
        recipe,
        head=args.head,
        compare=compare_heads(args.compare),
        out=args.out,
        tie_tolerance=args.tie_tolerance,
        progress=not args.no_progress and not args.json,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        for line in report["warnings"]:  # stdout stays machine-readable; the warnings go to stderr
            print(line, file=sys.stderr)
    else:
        print(format_report(report))
        print(f"wrote {paths['json']}, {paths['markdown']}, {paths['png']}, {paths['sequences']}")
    if report["lossless"]["passed"] is False:  # None: reduced precision, a rate instead
        raise CommandError("FAILED: speculative greedy output differs from plain greedy decoding")
    return 0
