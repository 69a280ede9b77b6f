"""Arguments every recipe-driven stage shares (the recipe, progress bars, the preflight
check), and the one way a command reports an error."""

from __future__ import annotations

import argparse


class CommandError(Exception):
    """A failure a command names for its user: `eyas.cli.main` prints `eyas STAGE: message`
    on stderr (never a traceback, also under -v) and exits with `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def add_recipe_arguments(
    parser: argparse.ArgumentParser, *, progress: bool = False, preflight: bool = False
) -> None:
    """The recipe and its overrides; with `progress`, --no-progress (a stage with progress
    bars); with `preflight`, --no-preflight (a stage that calls `run_preflight`)."""
    parser.add_argument("--recipe", "-r", help="YAML recipe (recipes/*.yaml); defaults apply when omitted")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="recipe overrides, e.g. train.learning_rate=2e-4 run_dir=runs/x",
    )
    if preflight:
        parser.add_argument(
            "--no-preflight",
            action="store_true",
            help="skip the check that the recipe fits the GPUs found here (eyas preflight)",
        )
    if progress:
        parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run_preflight(args: argparse.Namespace, recipe, stage: str) -> None:
    """Check that the recipe's `stage` fits the GPUs found here (eyas preflight), unless
    --no-preflight says not to."""
    if not args.no_preflight:
        from eyas.preflight_check import check_stage

        check_stage(recipe, stage, args.recipe or "")


def load_recipe_from_args(args: argparse.Namespace, writes: str | None = None):
    """The recipe of the command line; `writes` (the stage's name) when the stage writes
    its run dir, which it then holds for itself (eyas/run_lock.py)."""
    from eyas.recipe import load_recipe

    recipe = load_recipe(args.recipe, list(getattr(args, "overrides", None) or []))
    if writes:
        from eyas.run_lock import claim_run_dir

        claim_run_dir(recipe.run_dir, writes)
    return recipe
