"""Benchmark reply regeneration (`generate_replies_hf`, the prepare stage's decoder) on
SmolLM2-135M by batch size.

ShareGPT first prompts of at most --max-prompt-tokens tokens, sorted by token length and
cut into batches as `eyas prepare` does, each regenerated greedily to --max-new-tokens.
The same prompts run at every batch size, the sizes in turn for --rounds rounds (the best
round counts, so a noisy neighbour slows one round, not one size).

Prints one JSON object. Keys other tools read:
  reply_tokens_per_s   {batch_size: reply tokens per second}, best round
  speedup_over_first   {batch_size: reply_tokens_per_s / that of the first size}

usage: python scripts/bench_regenerate.py [--prompts 256] [--batch-sizes 64,128,256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from eyas.allocator import keep_freed_memory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch-sizes", default="64,128,256")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", default="smollm2-135m")
    args = ap.parse_args()
    keep_freed_memory()  # as every `eyas` command does
    sizes = [int(s) for s in args.batch_sizes.split(",")]

    from eyas.data.conversations import read_conversations
    from eyas.data.regenerate import before_first_reply, generate_replies_hf
    from eyas.data.targets import load_target
    from eyas.data.templates import TemplateError, prompt_ids

    target = load_target(args.target, dtype=args.dtype, device="cpu")
    convs, _ = read_conversations(["sharegpt"], max_samples=args.prompts * 3)
    prompts = []
    for conv in convs:
        first = before_first_reply(conv)
        try:
            p = prompt_ids(target.tokenizer, first)
        except TemplateError:
            continue
        if first and len(p) <= args.max_prompt_tokens:
            prompts.append(p)
        if len(prompts) == args.prompts:
            break
    prompts.sort(key=len)

    seconds = {bs: [] for bs in sizes}
    reply_tokens = {}
    for _ in range(args.rounds):
        for bs in sizes:
            start, n = time.perf_counter(), 0
            for i in range(0, len(prompts), bs):
                replies = generate_replies_hf(target.model, target.tokenizer, prompts[i:i + bs],
                                              args.max_new_tokens, 0.0, 1.0)
                n += sum(len(target.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)
            seconds[bs].append(time.perf_counter() - start)
            reply_tokens[bs] = n
    rate = {bs: reply_tokens[bs] / min(seconds[bs]) for bs in sizes}
    print(json.dumps({
        "settings": {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                     "max_prompt_tokens": args.max_prompt_tokens, "dtype": args.dtype, "rounds": args.rounds,
                     "threads": torch.get_num_threads(), "loadavg_before": os.getloadavg()[0]},
        "reply_tokens": {str(bs): reply_tokens[bs] for bs in sizes},
        "reply_tokens_per_s": {str(bs): round(rate[bs], 1) for bs in sizes},
        "speedup_over_first": {str(bs): round(rate[bs] / rate[sizes[0]], 3) for bs in sizes},
        "seconds": {str(bs): [round(s, 2) for s in seconds[bs]] for bs in sizes},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
