"""eyas eval: offline speculative decoding of a trained head (and the prompt-lookup
baseline) against the target on held-out prompts.

Reports tau (tokens per target forward), per-position acceptance, TAR, tokens/s of
speculative vs plain greedy decoding measured on this machine, and checks that greedy
speculative output equals plain greedy output token for token (exit 1 when it does not).

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

from eyas.commands._common import add_recipe_arguments, load_recipe_from_args

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
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
    parser.add_argument("--no-progress", action="store_true")


def compare_heads(specs: list[str]) -> dict[str, str]:
    """`[NAME=]HEAD` -> {name: head}; names must be unique and not a built-in drafter's."""
    out = {}
    for i, spec in enumerate(specs):
        name, sep, head = spec.partition("=")
        if not sep or "/" in name or not name:
            name, head = ("compare" if i == 0 else f"compare{i + 1}"), spec
        if name in out or name in ("head", "ngram", "plain"):
            raise SystemExit(f"eyas eval: --compare name {name!r} is taken; pass NAME=HEAD with another NAME")
        out[name] = head
    return out


def resolve_head(name: str) -> str:
    """A head directory from a local path or a Hub id (downloaded into the HF cache)."""
    from eyas.heads.export import ExportFormatError
    from eyas.heads.fetch import fetch_head

    try:
        return str(fetch_head(name))
    except ExportFormatError as err:
        raise SystemExit(f"eyas eval: {err}") from None


def load_eval_head(head_dir: str, target):
    """A head from an eyas checkpoint or an export directory, on the target's device;
    checked against the target's config as `eyas export --check --target` checks it."""
    from eyas.heads.head_dir import target_facts
    from eyas.heads.load_export import load_any_head
    from eyas.heads.validate import ExportValidationError

    embed = target.model.get_input_embeddings().weight.detach()
    try:
        head = load_any_head(
            head_dir, target_embed=embed, target=target_facts(target.model.config, "the target")
        )
    except ExportValidationError as err:
        raise SystemExit(f"eyas eval: {err}") from None
    cfg = head.config
    if cfg.vocab_size != target.vocab_size or cfg.target_hidden_size != target.hidden_size:
        raise SystemExit(
            f"eyas eval: head {head_dir} was built for vocab {cfg.vocab_size} / hidden "
            f"{cfg.target_hidden_size}, but the target has {target.vocab_size} / {target.hidden_size}"
        )
    device = embed.device
    return head.to(device=device, dtype=embed.dtype if device.type == "cuda" else None).eval()


def _replayed(drafters: dict, decode_baseline: bool) -> set[str]:
    """The baseline is replayed beside a head unless asked to decode; alone, it is what
    is being measured, so it is decoded."""
    if decode_baseline or "head" not in drafters:
        return set()
    return {"ngram"} & set(drafters)


def run(args: argparse.Namespace) -> int:
    from eyas.data.targets import load_target
    from eyas.eval.evaluate import run_eval
    from eyas.eval.ngram import NgramDrafter
    from eyas.eval.report import format_report, verdicts, write_outputs
    from eyas.eval.speculate import HeadDrafter
    from eyas.eval.workloads import load_workload

    recipe = load_recipe_from_args(args)
    ev = recipe.eval
    pick = lambda value, default: default if value is None else value  # noqa: E731
    k = pick(args.k, ev.k)
    if k < 1:
        raise SystemExit("eyas eval: --k must be at least 1")
    baseline = pick(args.baseline, ev.baseline or "none")
    head_dir = args.head
    if head_dir is None and (recipe.paths.export / "config.json").is_file():
        head_dir = str(recipe.paths.export)
    if head_dir is None and baseline == "none":
        raise SystemExit("eyas eval: nothing to evaluate: pass --head DIR or --baseline ngram")
    compared = compare_heads(args.compare)
    if compared and head_dir is None:
        raise SystemExit("eyas eval: --compare needs a --head to compare with")
    if head_dir is not None:
        head_dir = resolve_head(head_dir)
    compared = {name: resolve_head(h) for name, h in compared.items()}
    workload = pick(args.workload, ev.workload)
    prompts = load_workload(workload, pick(args.max_prompts, ev.max_prompts))  # before the target: fails fast
    t = recipe.target
    target = load_target(
        pick(args.target, t.name_or_path),
        dtype=pick(args.dtype, ev.dtype or t.dtype),
        device=t.device,
        attn_implementation=t.attn_implementation,
        trust_remote_code=t.trust_remote_code,
        revision=t.revision,
        work_rows=k + 1,
    )  # a verify step's rows
    drafters = {}
    if head_dir is not None:
        drafters["head"] = HeadDrafter(load_eval_head(head_dir, target))
    for name, other in compared.items():
        drafters[name] = HeadDrafter(load_eval_head(other, target))
    if baseline == "ngram":
        drafters["ngram"] = NgramDrafter(
            pick(args.ngram_min, ev.ngram_min), pick(args.ngram_max, ev.ngram_max)
        )
    temperature = pick(args.temperature, ev.temperature)
    max_new = pick(args.max_new_tokens, ev.max_new_tokens)
    body = run_eval(
        target.model,
        target.tokenizer,
        prompts,
        drafters,
        k,
        max_new,
        temperature,
        seed=pick(args.seed, ev.seed),
        tie_tolerance=args.tie_tolerance,
        progress=not args.no_progress and not args.json,
        replay=_replayed(drafters, pick(args.decode_baseline, ev.decode_baseline)),
    )
    report = {
        "target": target.hub_id,
        "head": head_dir,
        **({"compared": compared} if compared else {}),
        "algorithm": drafters["head"].head.config.algorithm if "head" in drafters else None,
        "workload": workload,
        "k": k,
        "temperature": temperature,
        "max_new_tokens": max_new,
        "device": str(target.model.device),
        "dtype": str(target.model.dtype).replace("torch.", ""),
        **body,
    }
    head_sum = report["drafters"].get("head")
    if head_sum:  # flat copies for the model card
        report.update({key: head_sum.get(key) for key in ("tau", "tar", "per_position_acceptance")})
    report["warnings"] = verdicts(report)
    paths = write_outputs(report, args.out or recipe.paths.eval)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        print(f"wrote {paths['json']}, {paths['markdown']}, {paths['png']}")
    if args.json:  # stdout stays machine-readable; the warnings go to stderr
        for line in report["warnings"]:
            print(line, file=sys.stderr)
    if not report["lossless"]["passed"]:
        print(
            "eyas eval: FAILED: speculative greedy output differs from plain greedy decoding", file=sys.stderr
        )
        return 1
    return 0
