"""`train.packing` against length-bucketed batches on ShareGPT chats: micro-batches per
epoch and training tokens per second, side by side in one process. Prints JSON.

  python scripts/bench_packing.py [--samples 160] [--batch-tokens 8192] [--steps 0]

The samples are ShareGPT conversations rendered with SmolLM2's template (their real
lengths, cut to the first `--max-turns` replies as the long-context recipe's chats are,
and at --max-length); each mode plans one epoch over them as the trainer does
(`plan_epoch`, groups as for a prepared dataset) and trains the head of the long-context
recipe's settings (the quickstart head with a 1,024-position window, TTT 2, copy
supervision; `--override` to change) on synthetic features at SmolLM2's shape for the
first `--warmup` micro-batches of its plan untimed, then the whole epoch (or its first
`--steps`) timed, the two modes taking turns batch by batch. Keys per mode:
steps_per_epoch, tokens_per_epoch (real tokens), fill (real tokens / the slots the
micro-batches hold), tokens_per_s (real tokens over the timed steps' seconds),
step_seconds, timed_steps, timed_seconds (the epoch's, when whole),
epoch_seconds_estimate (tokens_per_epoch / tokens_per_s); load_average: what else ran
(timings are noisy on a shared CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LONGCTX_SETTINGS = [
    "train.max_batch_size=16",
    "head.sliding_window=1024",
    "train.eagle3.ttt_steps=2",
    "train.eagle3.copy_attention_weight=1.0",
]


def sharegpt_lengths(n: int, max_length: int, max_turns: int | None) -> list[int]:
    """Token counts of the first `n` ShareGPT conversations that render, cut to their first
    `max_turns` replies (the long-context recipe keeps one) and at max_length tokens."""
    from eyas.data.conversations import read_conversations
    from eyas.data.samples import keep_first_turns
    from eyas.data.templates import TemplateError, render_with_mask
    from eyas.target.load import load_target

    tok = load_target("smollm2-135m", "float32", "cpu").tokenizer
    convs, _ = read_conversations(["sharegpt"], max_samples=n * 2)
    lengths = []
    for c in convs:
        if max_turns is not None:
            c = keep_first_turns(c, max_turns)
        try:
            r = render_with_mask(tok, c, "all", 1 << 16)
        except TemplateError:
            continue
        if sum(r.loss_mask) > 0:
            lengths.append(min(len(r.input_ids), max_length))
        if len(lengths) == n:
            break
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--max-turns", type=int, default=1, help="replies kept per chat (0: all)")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=0, help="timed micro-batches per mode (0: the whole epoch)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed micro-batches per mode first")
    ap.add_argument("--override", action="append", default=[], help="recipe override (key=value)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    sys.path.insert(0, HERE)
    from bench_head_step import target_config

    from eyas.recipe import load_recipe
    from eyas.train.batching import dataset_groups, plan_epoch
    from eyas.train.step_timing import build_head_step, packed_row, synthetic_batch

    overrides = [*LONGCTX_SETTINGS, f"train.batch_tokens={args.batch_tokens}", *args.override]
    recipe = load_recipe(os.path.join(HERE, "..", "recipes", "smollm2-135m-eagle3.yaml"), overrides)
    tr = recipe.train
    lengths = sharegpt_lengths(args.samples, args.max_length, args.max_turns or None)
    groups = dataset_groups(len(lengths), tr.seed, 64 * tr.max_batch_size)  # as dataset_samples
    cfg_t = target_config("smollm2-135m")
    step = build_head_step(recipe, cfg_t, "smollm2-135m", torch.device("cpu"), rows=tr.batch_tokens)
    gen = torch.Generator().manual_seed(0)
    modes = {}
    for name, packed in (("unpacked", False), ("packed", True)):
        plan = plan_epoch(lengths, groups, tr.batch_tokens, tr.max_batch_size, tr.seed, 0, packed=packed)
        slots = sum(len(b) * max(lengths[i] for i in b) if not packed else tr.batch_tokens for b in plan)
        modes[name] = {
            "plan": plan,
            "packed": packed,
            "steps_per_epoch": len(plan),
            "tokens_per_epoch": sum(lengths[i] for b in plan for i in b),
            "fill": round(sum(lengths[i] for b in plan for i in b) / slots, 3),
            "seconds": [],
            "tokens": 0,
        }
    for m in modes.values():
        timed = len(m["plan"]) if args.steps == 0 else args.steps
        m["order"] = [i % len(m["plan"]) for i in range(args.warmup)] + [
            i % len(m["plan"]) for i in range(timed)
        ]
    for n in range(max(len(m["order"]) for m in modes.values())):
        for m in modes.values():  # taking turns, so a load spike hits both
            if n >= len(m["order"]):
                continue
            idx = m["plan"][m["order"][n]]
            lens = [lengths[i] for i in idx]
            batch = synthetic_batch(
                len(lens), max(lens), cfg_t.vocab_size, step.aux_width, cfg_t.hidden_size, "cpu", gen, lens
            )
            if m["packed"]:
                batch = packed_row(batch, lens)
            t0 = time.perf_counter()
            step.run(batch)
            if n >= args.warmup:
                m["seconds"].append(round(time.perf_counter() - t0, 3))
                m["tokens"] += sum(lens)
    out = {}
    for name, m in modes.items():
        rate = m["tokens"] / sum(m["seconds"])
        out[name] = {
            "steps_per_epoch": m["steps_per_epoch"],
            "tokens_per_epoch": m["tokens_per_epoch"],
            "fill": m["fill"],
            "tokens_per_s": round(rate, 1),
            "step_seconds": m["seconds"],
            "timed_steps": len(m["seconds"]),
            "timed_seconds": round(sum(m["seconds"]), 1),
            "epoch_seconds_estimate": round(m["tokens_per_epoch"] / rate, 1),
        }
    result = {
        "samples": len(lengths),
        "median_sample_tokens": sorted(lengths)[len(lengths) // 2],
        "max_turns": args.max_turns or None,
        "batch_tokens": tr.batch_tokens,
        "max_batch_size": tr.max_batch_size,
        "overrides": overrides,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        **out,
        "speedup_epoch": round(
            out["unpacked"]["epoch_seconds_estimate"] / out["packed"]["epoch_seconds_estimate"], 2
        ),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
