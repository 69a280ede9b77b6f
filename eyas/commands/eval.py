"""eyas eval (not implemented yet)."""

from __future__ import annotations

import argparse

from eyas.commands._common import add_recipe_arguments, not_implemented


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return not_implemented("eval")
