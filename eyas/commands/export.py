"""eyas export: write a trained head in the layout vLLM serves (DESIGN §5), validate it,
and print the serving command.

The checkpoint is an eyas head directory (head_config.json + head.safetensors), by
default run_dir/checkpoints/final of the recipe; the output defaults to run_dir/export.
Every export is validated; `--check DIR` validates an existing export (yours or a
published one) and exits non-zero listing every problem.

examples:
  eyas export -r recipes/smollm2-135m-eagle3.yaml
  eyas export --checkpoint runs/x/checkpoints/final --out heads/x \
      --verifier HuggingFaceTB/SmolLM2-135M-Instruct
  eyas export --checkpoint C --out D --format eagle --dtype float16
  eyas export --check heads/x
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--checkpoint", "-c", help="eyas head dir (default: run_dir/checkpoints/final)")
    parser.add_argument("--out", "-o", help="output directory (default: run_dir/export)")
    parser.add_argument(
        "--format",
        choices=("speculators", "eagle"),
        default=None,
        help="speculators (default; what vLLM reads natively) or the original EAGLE-3 layout",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of the exported weights (d2t stays int64, t2d bool)",
    )
    parser.add_argument(
        "--verifier",
        help="the target's Hub id written as verifier name_or_path "
        "(default: the one the head was trained with)",
    )
    parser.add_argument(
        "--check",
        metavar="DIR",
        help="only validate an existing head (a directory or a Hub id: "
        "an eyas export or a published head in the speculators or EAGLE-3 layout) and exit",
    )
    parser.add_argument(
        "--target",
        help="with --check: the verifier (local dir, alias or cached Hub id) whose "
        "config the head must agree with (default: the one the head names, when it is on this machine)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _print_problems(header: str, problems: list[str]) -> None:
    print(header, file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)


def check_target_facts(target: str | None):
    """The verifier's facts for a head check, from `--target` (None: the head's own)."""
    if not target:
        return None
    from eyas.export.head_dir import target_facts
    from eyas.target.load import load_target_config

    return target_facts(load_target_config(target), target)


def _check(name: str, target: str | None, as_json: bool) -> int:
    from eyas.export.fetch import fetch_head
    from eyas.export.writer import ExportFormatError

    try:
        head_dir = str(fetch_head(name))
    except ExportFormatError as err:
        problems, notes, head_dir, unchecked = [str(err)], [], name, None
    else:
        hd, unchecked = _inspect_against_verifier(head_dir, check_target_facts(target))
        problems, notes = hd.problems, hd.notes
    ok = not problems and unchecked is None
    if as_json:
        print(
            json.dumps(
                {"dir": head_dir, "ok": ok, "problems": problems, "notes": notes, "not_checked": unchecked}
            )
        )
        return 0 if ok else 1
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if problems:
        _print_problems(f"{name}: {len(problems)} problem(s):", problems)
    if unchecked:
        print(f"{name}: NOT CHECKED against its verifier: {unchecked}", file=sys.stderr)
    if ok:
        print(f"{name}: OK (matches the serving contract)")
    return 0 if ok else 1


def _inspect_against_verifier(head_dir: str, facts):
    """The head read against `facts` (from --target), else against the verifier it names,
    whose config is fetched from the Hub when it is not on this machine; and, when that
    verifier could not be read, the line saying why its shapes went unchecked."""
    from eyas.export.fetch import fetch_verifier_facts
    from eyas.export.validate import inspect_export

    hd, _ = inspect_export(head_dir, facts)
    verifier = hd.fields.get("verifier")
    if facts is not None or hd.target is not None or not isinstance(verifier, str) or not verifier:
        return hd, None
    facts, why = fetch_verifier_facts(verifier)
    if facts is None:
        return hd, (
            f"{verifier}: {why}; pass --target (the verifier's directory or a cached Hub id), "
            "or run where the Hub is reachable"
        )
    return inspect_export(head_dir, facts)[0], None


def _paths(args):
    ckpt, out, fmt, verifier = args.checkpoint, args.out, args.format, args.verifier
    if args.recipe or not (ckpt and out):
        recipe = load_recipe_from_args(args)
        ckpt = ckpt or str(recipe.paths.checkpoints / "final")
        out = out or str(recipe.paths.export)
        fmt = fmt or recipe.export.format
        verifier = verifier or _recipe_verifier(recipe, ckpt)
    return ckpt, out, fmt or "speculators", verifier


def _recipe_verifier(recipe, ckpt) -> str | None:
    """The verifier to name: `target.hub_id` when the recipe sets it (it corrects a head
    trained from a local directory); else the recipe's target, only when the head config
    names none."""
    from eyas.heads.io import CONFIG_NAME as HEAD_CONFIG_NAME
    from eyas.target.load import SMOLLM2_ALIAS, SMOLLM2_HUB_ID

    if recipe.target.hub_id:
        return recipe.target.hub_id
    cfg_path = Path(ckpt) / HEAD_CONFIG_NAME
    if cfg_path.is_file() and json.loads(cfg_path.read_text()).get("verifier_name_or_path"):
        return None
    name = recipe.target.name_or_path
    return SMOLLM2_HUB_ID if name == SMOLLM2_ALIAS else name


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args.check, args.target, args.json)
    from eyas.export.hub import write_training_summary
    from eyas.export.validate import validate_export
    from eyas.export.writer import DTYPES, ExportFormatError, export_checkpoint, serve_command

    ckpt, out, fmt, verifier = _paths(args)
    try:
        out_dir = export_checkpoint(ckpt, out, fmt=fmt, dtype=DTYPES[args.dtype], verifier=verifier)
    except (ExportFormatError, ValueError, FileNotFoundError) as err:
        raise CommandError(str(err)) from None
    write_training_summary(ckpt, out_dir)
    problems = validate_export(out_dir)
    from eyas.heads.config import DraftHeadConfig
    from eyas.heads.io import CONFIG_NAME as HEAD_CONFIG_NAME

    cfg = DraftHeadConfig.load(Path(ckpt) / HEAD_CONFIG_NAME)
    if verifier:
        cfg = cfg.model_copy(update={"verifier_name_or_path": verifier})
    command = serve_command(out_dir.resolve(), cfg)
    if args.json:
        print(
            json.dumps(
                {
                    "dir": str(out_dir),
                    "format": fmt,
                    "ok": not problems,
                    "problems": problems,
                    "serve": command,
                }
            )
        )
    else:
        if problems:
            _print_problems(f"eyas export: the export in {out_dir} breaks the serving contract:", problems)
        else:
            print(f"exported {cfg.algorithm} head ({fmt}, {args.dtype}) to {out_dir}; validated")
            print("serve it with:")
            print(f"  {command}")
            if fmt == "speculators":
                print(f"  (or: vllm serve {out_dir.resolve()}  — the verifier comes from config.json)")
    return 1 if problems else 0
