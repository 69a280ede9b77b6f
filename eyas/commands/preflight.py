"""eyas preflight: does a recipe fit the GPUs it will run on (DESIGN §2.9)?

From the target's config.json alone (a local directory, the Hugging Face cache or the
published configs shipped with eyas; the model is built on the meta device, no weights)
and the recipe: per stage (regenerate, capture, train) what each rank holds at its peak,
the regeneration engine's TP x DP layout and KV room, the feature cache on disk and a
roofline time per million tokens. Says what does not fit and which knob fixes it; exits
1 when a stage cannot fit. `eyas prepare` and `eyas train` run the same check on the
GPUs they find (--no-preflight skips it).

The hardware defaults to what the recipe's header states (`# preflight: --gpu H200
--gpus 8`), else 8 x H100-80.

examples:
  eyas preflight -r recipes/gpt-oss-120b-eagle3.yaml
  eyas preflight -r recipes/gpt-oss-120b-eagle3.yaml --gpu A100-40 --gpus 4
  eyas preflight -r recipes/qwen3-coder-30b-a3b-eagle3.yaml --strategy fsdp --json
  eyas preflight --table recipes/*.yaml     # docs/distributed.md's "what fits where"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eyas.commands._common import CommandError, add_recipe_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--gpu", help="a GPU profile (H100, H200, B200, A100, ...; NAME-GB sets its memory)")
    parser.add_argument("--gpus", type=int, help="GPUs per node")
    parser.add_argument("--nodes", type=int, help="nodes")
    parser.add_argument(
        "--strategy", choices=("ddp", "zero2", "fsdp", "zero3"), help="how the head is sharded"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--table", nargs="+", metavar="RECIPE", help="print the 'what fits where' table of these recipes"
    )


def hardware_for(path: str | None, args) -> dict:
    from eyas.preflight_check import header_hardware

    stated = header_hardware(Path(path).read_text()) if path else None
    hw = stated or {"gpu": "H100-80", "gpus": 8, "nodes": 1, "strategy": "ddp"}
    for key in ("gpu", "gpus", "nodes", "strategy"):
        if getattr(args, key, None) is not None:
            hw[key] = getattr(args, key)
    return hw


def run(args: argparse.Namespace) -> int:
    from eyas.preflight import preflight
    from eyas.preflight_check import fits_table, format_preflight, refusal
    from eyas.recipe import load_recipe

    if args.table:
        print(fits_table(args.table))
        return 0
    recipe = load_recipe(args.recipe, list(args.overrides or []))
    p = preflight(recipe, recipe_name=args.recipe or "<defaults>", **hardware_for(args.recipe, args))
    print(json.dumps(p.as_dict(), indent=1) if args.json else format_preflight(p))
    if not p.fits:
        raise CommandError(refusal(p))
    return 0
