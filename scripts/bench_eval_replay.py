"""Benchmark the eval's head replay (DESIGN §6): a recipe's eval run twice on one loaded
target, every prompt decoded by the head, then only `--decoded-prompts` of them (the
rest replayed over the plain greedy tokens). Reports each run's wall time and τ, and how
many replayed turns differ step by step from the decoded ones (float rounding in the
target's states can flip a near-tie draft; the tests pin the exact case).

Prints one JSON object. Keys other tools read:
  seconds        {"decoded": s, "replayed": s}: the whole eval (plain decoding included)
  tau            {"decoded": τ, "replayed": τ} of the head
  turns_compared replayed turns set against their decoded twins
  turns_differing, steps_differing   of those, the turns / verify steps whose acceptance differs

usage: python scripts/bench_eval_replay.py --recipe recipes/smollm2-135m-eagle3.yaml \\
           --head runs/smollm2-135m-eagle3/export [--decoded-prompts 2] [--max-prompts 10] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from eyas.core.record_log import read_records
from eyas.eval.eval_settings import EvalSettings
from eyas.eval.evaluate import load_eval_head, run_eval
from eyas.eval.ngram import NgramDrafter
from eyas.eval.speculate import HeadDrafter
from eyas.eval.workloads import load_workload
from eyas.recipe import load_recipe
from eyas.target.load import load_recipe_target


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--decoded-prompts", type=int, default=2)
    parser.add_argument("--max-prompts", type=int)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    ev = recipe.eval
    prompts = load_workload(ev.workload, args.max_prompts or ev.max_prompts)
    target = load_recipe_target(recipe.target, work_rows=ev.k + 1, dtype=ev.dtype or "float32")
    head = load_eval_head(args.head, target)
    seconds, reports, logs = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, decoded in (("decoded", None), ("replayed", args.decoded_prompts)):
            section = ev.model_copy(update={"decoded_prompts": decoded})
            settings = EvalSettings.from_section(section, {"ngram"})
            drafters = {"head": HeadDrafter(head), "ngram": NgramDrafter(ev.ngram_min, ev.ngram_max)}
            log = Path(tmp) / f"{mode}.jsonl"  # the traces, turn by turn
            start = time.perf_counter()
            reports[mode] = run_eval(
                target.model, target.tokenizer, prompts, drafters, settings, progress=True, record_path=log
            )
            seconds[mode] = round(time.perf_counter() - start, 1)
            logs[mode] = {rec["index"]: rec["turns"] for rec in read_records(log)[0]}
    decoded_at = settings.decoded_at(len(prompts))  # the replayed run's
    turns = steps = turns_differing = steps_differing = 0
    for index, replayed_turns in logs["replayed"].items():
        if index in decoded_at:
            continue
        for a, b in zip(logs["decoded"][index], replayed_turns):
            x, y = a["drafters"]["head"]["accepted"], b["drafters"]["head"]["accepted"]
            turns += 1
            steps += len(x)
            turns_differing += x != y
            steps_differing += sum(i != j for i, j in zip(x, y)) + abs(len(x) - len(y))
    out = {
        "recipe": args.recipe,
        "head": args.head,
        "prompts": len(prompts),
        "decoded_prompts": len(decoded_at),
        "seconds": seconds,
        "tau": {mode: r["drafters"]["head"]["tau"] for mode, r in reports.items()},
        "per_position_acceptance": {
            mode: r["drafters"]["head"]["per_position_acceptance"] for mode, r in reports.items()
        },
        "turns_compared": turns,
        "steps_compared": steps,
        "turns_differing": turns_differing,
        "steps_differing": steps_differing,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
