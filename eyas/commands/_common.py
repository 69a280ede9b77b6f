"""Arguments every recipe-driven stage shares, and the one way a command reports an error."""

from __future__ import annotations

import argparse


class CommandError(Exception):
    """A failure a command names for its user: `eyas.cli.main` prints `eyas STAGE: message`
    on stderr (never a traceback, also under -v) and exits with `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", "-r", help="YAML recipe (recipes/*.yaml); defaults apply when omitted")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="recipe overrides, e.g. train.learning_rate=2e-4 run_dir=runs/x",
    )


def load_recipe_from_args(args: argparse.Namespace, writes: str | None = None):
    """The recipe of the command line; `writes` (the stage's name) when the stage writes
    its run dir, which it then holds for itself (eyas/run_lock.py)."""
    from eyas.recipe import load_recipe

    recipe = load_recipe(args.recipe, list(getattr(args, "overrides", None) or []))
    if writes:
        from eyas.run_lock import claim_run_dir

        claim_run_dir(recipe.run_dir, writes)
    return recipe
