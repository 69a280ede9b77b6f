"""Benchmark reply regeneration (`decode_replies_hf` in data/decode.py, the prepare stage's decoder) on
SmolLM2-135M by batch size.

ShareGPT first prompts of at most --max-prompt-tokens tokens, sorted by token length and
cut into batches as `eyas prepare` does, each regenerated greedily to --max-new-tokens.
The same prompts run at every batch size, the sizes in turn for --rounds rounds (the best
round counts, so a noisy neighbour slows one round, not one size). `--states both` runs
every size also keeping the target's states of the fed tokens (`data.regenerate.keep_states`,
what `eyas capture` then copies), as the variant "<size>+states".

Prints one JSON object. Keys other tools read:
  reply_tokens_per_s   {batch_size: reply tokens per second}, best round
  speedup_over_first   {batch_size: reply_tokens_per_s / that of the first size}
  states_cost          {batch_size: seconds with states / without - 1} (--states both)

usage: python scripts/bench_regenerate.py [--prompts 256] [--batch-sizes 64,128,256] [--rounds 2]
                                         [--states off|on|both]
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
    ap.add_argument("--states", choices=["off", "on", "both"], default="off",
                    help="keep the fed tokens' states (data.regenerate.keep_states): off, on, or both variants")
    args = ap.parse_args()
    keep_freed_memory()  # as every `eyas` command does
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.states]
    sizes = [(int(s), keep) for s in args.batch_sizes.split(",") for keep in modes]

    from eyas.data.conversations import read_conversations
    from eyas.data.fed_states import fed_state_layer_ids
    from eyas.data.decode import decode_replies_hf
    from eyas.data.regenerate import before_first_reply
    from eyas.data.targets import default_aux_layer_ids, load_target
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
    layer_ids = fed_state_layer_ids(default_aux_layer_ids(target.num_layers), target.num_layers)

    def name(variant):
        return f"{variant[0]}+states" if variant[1] else str(variant[0])

    seconds = {v: [] for v in sizes}
    reply_tokens = {}
    for _ in range(args.rounds):
        for bs, keep in sizes:
            start, n = time.perf_counter(), 0
            for i in range(0, len(prompts), bs):
                replies = decode_replies_hf(target.model, target.tokenizer, prompts[i:i + bs], args.max_new_tokens,
                                            0.0, 1.0, state_layer_ids=layer_ids if keep else None)
                n += sum(len(target.tokenizer(r.text, add_special_tokens=False)["input_ids"]) for r in replies)
            seconds[bs, keep].append(time.perf_counter() - start)
            reply_tokens[bs, keep] = n
    rate = {v: reply_tokens[v] / min(seconds[v]) for v in sizes}
    states_cost = {str(bs): round(min(seconds[bs, True]) / min(seconds[bs, False]) - 1, 3)
                   for bs, keep in sizes if keep and (bs, False) in seconds}
    print(json.dumps({
        "settings": {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                     "max_prompt_tokens": args.max_prompt_tokens, "dtype": args.dtype, "rounds": args.rounds,
                     "threads": torch.get_num_threads(), "loadavg_before": os.getloadavg()[0]},
        "reply_tokens": {name(v): reply_tokens[v] for v in sizes},
        "reply_tokens_per_s": {name(v): round(rate[v], 1) for v in sizes},
        "speedup_over_first": {name(v): round(rate[v] / rate[sizes[0]], 3) for v in sizes},
        "seconds": {name(v): [round(s, 2) for s in seconds[v]] for v in sizes},
        **({"states_cost": states_cost} if states_cost else {}),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
