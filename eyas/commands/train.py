"""eyas train: train the draft head a recipe describes (DESIGN §2.4).

Reads run_dir/prepared (token frequencies; the dataset in online and engine mode) and,
with data.features=offline, run_dir/cache from `eyas capture`; with data.features=engine
the states come from the vLLM engine data.capture describes (started and stopped by the
run, or running at data.capture.server_url). Writes run_dir/recipe.yaml,
metrics (run_dir/metrics.jsonl, tensorboard/ or wandb/), checkpoints every
train.save_every steps under run_dir/checkpoints/step-N (full state; a rerun resumes from
the newest) and the trained head in run_dir/checkpoints/final (read by `eyas export`).
A rerun of a finished run does nothing; a rerun whose recipe changed what the head is
trained under (head, train hyperparameters, features, the prepared data) is refused,
naming the keys, unless --accept-changes or --restart says otherwise.

examples:
  eyas train -r recipes/smollm2-135m-eagle3.yaml
  eyas train -r R train.max_steps=200 train.logger=tensorboard
  eyas train -r R train.max_steps=400 --accept-changes   # train a finished run on to step 400
  eyas train -r R train.learning_rate=3e-4 --restart     # the same run dir, trained anew
  accelerate launch --config_file recipes/accelerate/ddp.yaml -m eyas.train -r R
"""

from __future__ import annotations

import argparse
import json
import logging

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args, run_preflight


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, progress=True, preflight=True)
    parser.add_argument("--json", action="store_true", help="print the run summary as JSON")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="delete this run dir's checkpoints, head and metrics and train anew (the prepared "
        "data and the cache stay)",
    )
    parser.add_argument(
        "--accept-changes",
        action="store_true",
        help="resume a run whose recipe changed since its last checkpoint; the new settings "
        "apply from that step on (without it such a rerun is refused, naming the keys)",
    )


def run(args: argparse.Namespace) -> int:
    from eyas.train.loop import TrainingStopped, train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    recipe = load_recipe_from_args(args, writes="train")
    run_preflight(args, recipe, "train")
    try:
        summary = train(
            recipe, progress=not args.no_progress, restart=args.restart, accept_changes=args.accept_changes
        )
    except (TrainingStopped, FileNotFoundError, ValueError) as err:
        raise CommandError(str(err)) from None
    if not summary["is_main_process"]:
        return 0
    if args.json:
        print(json.dumps(summary))
    elif summary.get("already_finished"):
        print(
            f"eyas train: {recipe.paths.root} finished training at step {summary['step']}; nothing to do "
            f"(head in {summary['final_dir']}; --restart trains anew)"
        )
    else:
        ev = summary["eval"]
        extra = f", eval acceptance length {ev['eval/accept_len']:.2f}" if "eval/accept_len" in ev else ""
        print(f"trained {summary['step']} steps{extra}; head in {summary['final_dir']}")
    return 0
