"""eyas budget: size a run to a time budget on this machine.

Measures this machine on the recipe's own work (one regeneration batch, whose replies
prepare then keeps; a target forward at the capture's batch; a few training steps; plain
decoding at the eval's dtype), estimates each stage, and chooses data.max_samples and
train.epochs so the run fits the budget; never more than the recipe's. Prints the
overrides to pass to every stage, one per line, on stdout (the reasons go to the log),
and writes them with the estimates to run_dir/budget.json; a rerun with the same budget
reuses that file. With --report, sets each stage's time against its estimate and its
share of the budget. With --train-limit, prints the train.max_minutes that leaves export
and eval their estimates when training starts --spent seconds into the budget.

examples:
  eyas budget -r recipes/smollm2-135m-eagle3.yaml --budget 30m --spent 60
  eyas budget -r recipes/smollm2-135m-eagle3.yaml --budget 30m --spent 900 --train-limit
  eyas budget -r recipes/smollm2-135m-eagle3.yaml --budget 30m --report setup=60 prepare=480 train=700
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, progress=True)
    parser.add_argument(
        "--budget", default="30m", help="the whole run's time, e.g. 30m, 1.5h, 90s (default 30m)"
    )
    parser.add_argument(
        "--spent",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds of the budget already spent (setting up)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="the overrides are stage=seconds: print them against the sizing's estimates",
    )
    parser.add_argument(
        "--train-limit",
        action="store_true",
        help="print train.max_minutes for a training that starts --spent seconds into the budget, "
        "from run_dir/budget.json (nothing when the command line sets train.max_minutes)",
    )
    parser.add_argument("--json", action="store_true", help="print the sizing (or the report's rows) as JSON")


def run(args: argparse.Namespace) -> int:
    from eyas.budget import SIZED_KEYS, BudgetError, parse_duration, size_run

    try:
        budget_s = parse_duration(args.budget)
    except BudgetError as err:
        raise CommandError(str(err), code=2) from None
    if args.report:
        return _report(args, budget_s)
    if args.train_limit:
        return _train_limit(args, budget_s)
    recipe = load_recipe_from_args(args, writes="prepare")
    fixed = tuple(k for k in SIZED_KEYS if _overrides(args, k))
    try:
        with _stdout_to_stderr():
            sized = size_run(recipe, budget_s, args.spent, fixed, progress=not args.no_progress)
    except BudgetError as err:
        raise CommandError(str(err)) from None
    for line in sized["reasons"]:
        print(f"eyas budget: {line}", file=sys.stderr)
    print(f"eyas budget: written to {recipe.paths.budget}", file=sys.stderr)
    if args.json:
        print(json.dumps(sized, indent=1))
    else:
        print("\n".join(sized["overrides"]))
    return 0


@contextlib.contextmanager
def _stdout_to_stderr():
    """Stdout is this command's answer (the quickstart reads it line by line): while the
    probe runs, whatever the libraries print there (DeepSpeed's accelerator notice, from
    its own handler on fd 1) goes to stderr instead."""
    sys.stdout.flush()
    saved_fd, saved = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved


def _overrides(args: argparse.Namespace, key: str) -> bool:
    """Whether the command line sets `key` (a value the budget leaves as the user gave it)."""
    return any(o.split("=", 1)[0] == key for o in args.overrides)


def _train_limit(args: argparse.Namespace, budget_s: float) -> int:
    from eyas.budget import train_minutes

    if _overrides(args, "train.max_minutes"):
        return 0  # the user's own limit stands
    recipe = load_recipe_from_args(args)
    path = recipe.paths.budget
    if not path.is_file():
        raise CommandError(f"{path} does not exist: size the run first (eyas budget without --train-limit)")
    print(f"train.max_minutes={train_minutes(json.loads(path.read_text()), budget_s, args.spent):.2f}")
    return 0


def _report(args: argparse.Namespace, budget_s: float) -> int:

    from eyas.budget import report
    from eyas.recipe import load_recipe

    took, overrides = {}, []
    for (
        item
    ) in args.overrides:  # stage=seconds, or a recipe override (run_dir=...) saying where budget.json is
        key, _, value = item.partition("=")
        if "." not in key and key not in ("run_dir", "name") and value.replace(".", "", 1).isdigit():
            took[key] = float(value)
        else:
            overrides.append(item)
    recipe = load_recipe(args.recipe, overrides)
    path = recipe.paths.budget
    sized = json.loads(path.read_text()) if path.is_file() else {}
    sized["budget_s"] = budget_s
    print(report(sized, took))
    if path.is_file():
        sized["took_s"] = took
        path.write_text(json.dumps(sized, indent=1) + "\n")
    return 0
