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

examples:
  eyas capture run_dir=runs/smol
  eyas capture -r R data.cache_dtype=fp8 data.capture_batch_tokens=16384
  eyas capture run_dir=runs/smol --verify      # name damaged or missing shards
"""

from __future__ import annotations

import argparse
import shutil
import sys

from eyas.commands._common import add_recipe_arguments, load_recipe_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
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
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    from eyas.data.cache import bytes_per_token, read_manifest, verify_cache

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

    from eyas.data.capture import CaptureError, capture_split
    from eyas.data.fed_states import FED_STATES_DIR, FedStates, fed_state_layer_ids
    from eyas.data.prepare import load_prepared, read_prepared_digest
    from eyas.data.targets import default_aux_layer_ids, load_target

    if recipe.data.features == "online":
        print(
            "eyas capture: data.features=online: the trainer computes the features itself; nothing to capture"
        )
        return 0
    prepared = recipe.paths.prepared
    if not (prepared / "dataset").is_dir():
        print(f"eyas capture: no prepared data at {prepared}; run `eyas prepare` first", file=sys.stderr)
        return 1
    dd = load_prepared(prepared)
    splits = [s for s in splits if s in dd]  # an empty eval split is not written
    t = recipe.target
    target = load_target(
        t.name_or_path,
        t.dtype,
        t.device,
        t.attn_implementation,
        t.trust_remote_code,
        t.revision,
        work_rows=recipe.data.capture_batch_tokens,
    )
    aux_ids = list(recipe.data.aux_layer_ids or default_aux_layer_ids(target.num_layers))
    bpt = bytes_per_token(len(aux_ids), target.hidden_size, recipe.data.cache_dtype)
    total = sum(len(x) for s in splits for x in dd[s]["input_ids"])
    print(
        f"capture: aux layers {aux_ids}, {recipe.data.cache_dtype} cache, {bpt} bytes/token x {total} tokens "
        f"= {bpt * total / 1e9:.3f} GB estimated, into {cache}"
    )
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    fed_dir = prepared / FED_STATES_DIR
    fed = (
        FedStates(fed_dir, fed_state_layer_ids(aux_ids, target.num_layers), t.name_or_path)
        if fed_dir.is_dir()
        else None
    )
    if fed is not None:
        print(
            f"capture: {fed_dir} holds the regeneration's states of {len(fed)} conversations; they are "
            f"copied "
            "where the prepared tokens match"
        )
    try:
        for s in splits:
            if args.overwrite:
                shutil.rmtree(cache / s, ignore_errors=True)
            m = capture_split(
                target.model,
                dd[s],
                cache / s,
                aux_ids,
                recipe.data.cache_dtype,
                recipe.data.capture_batch_tokens,
                recipe.data.shard_tokens,
                pad,
                t.name_or_path,
                progress=not args.no_progress,
                fed_states=fed,
                prepared_digest=read_prepared_digest(prepared),
            )
            copied = sum(sh.get("copied_samples", 0) for sh in m["shards"])
            print(
                f"{cache / s}: {m['num_samples']} samples ({copied} copied from regeneration), "
                f"{m['num_tokens']} tokens, {len(m['shards'])} shards"
            )
    except CaptureError as err:
        print(f"eyas capture: {err}", file=sys.stderr)
        return 1
    if fed is not None and all((read_manifest(cache / s) or {}).get("complete") for s in dd):
        # Every prepared split is captured: the states live on in the cache.
        size = sum(f.stat().st_size for f in fed_dir.glob("*"))
        shutil.rmtree(fed_dir)
        print(f"capture: removed {fed_dir} ({size / 1e9:.2f} GB), the cache holds its states now")
    return 0
