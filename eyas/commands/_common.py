"""Arguments every recipe-driven stage shares."""

from __future__ import annotations

import argparse
import sys


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", "-r", help="YAML recipe (recipes/*.yaml); defaults apply when omitted")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="recipe overrides, e.g. train.learning_rate=2e-4 run_dir=runs/x")


def load_recipe_from_args(args: argparse.Namespace):
    from eyas.recipe import load_recipe

    return load_recipe(args.recipe, list(getattr(args, "overrides", None) or []))


def not_implemented(stage: str) -> int:
    print(f"eyas {stage}: not implemented yet", file=sys.stderr)
    return 2
