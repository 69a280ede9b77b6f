"""`scripts/bench_train.py --algorithms`: training algorithms' steps on the same cached
batches, the heads taking turns. See that script's docstring."""

from __future__ import annotations

import json
import os
import resource

import torch
from bench_train_common import load_bench_data, recipe_of, train_step, trainable


def compare_algorithms(args) -> None:
    """Each head's optimizer step on the same offline batches, the heads taking turns batch
    by batch (this CPU's speed drifts over minutes; turns keep the ratio fair)."""
    loadavg_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [(a, a, []) for a in args.algorithms.split(",") if a]
    for v in args.variant:
        name, _, rest = v.partition(":")
        overrides = [o for o in rest.split(",") if o]
        algo = next((o.split("=", 1)[1] for o in overrides if o.startswith("head.algorithm=")), "eagle3")
        specs.append((name, algo, [o for o in overrides if not o.startswith("head.algorithm=")]))
    recipes = {name: recipe_of(algo, overrides) for name, algo, overrides in specs}
    target, batches, freqs, bf16_autocast = load_bench_data(args)
    runs = {}
    for name, recipe in recipes.items():
        run = trainable(recipe, target, freqs, bf16_autocast)
        run["cached"] = [run["features"].complete(dict(b))[0] for b in batches]  # the offline cache
        runs[name] = run

    def step(run: dict, i: int) -> float:
        return train_step(run, run["cached"][i])

    names = list(runs)
    for name in names:  # warm-up, untimed
        step(runs[name], 0)
    seconds = {n: [0.0] * args.rounds for n in names}
    turn = 0
    for r in range(args.rounds):
        for i in range(1, len(batches)):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                seconds[name][r] += step(runs[name], i)
            turn += 1
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:])
    per_token = {n: min(seconds[n]) / tokens for n in names}
    result = {
        "settings": {
            "heads": {
                n: {
                    "algorithm": runs[n]["recipe"].head.algorithm,
                    "num_layers": runs[n]["recipe"].head.num_layers,
                    "train": runs[n]["recipe"].train.section(runs[n]["recipe"].head.algorithm).model_dump(),
                }
                for n in names
            },
            "seq": args.seq,
            "batch": args.batch,
            "timed_steps": args.steps,
            "rounds": args.rounds,
            "threads": torch.get_num_threads(),
            "loadavg_before": loadavg_before,
            "loadavg_after": os.getloadavg()[0],
            "target_dtype": str(target.model.dtype).removeprefix("torch."),
            "bf16_autocast": bf16_autocast,
        },
        "seconds_per_token": per_token,
        "ratio_to_first": {n: per_token[n] / per_token[names[0]] for n in names},
        "seconds": seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(result, indent=1))
