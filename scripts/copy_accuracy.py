"""Does a head copy from its context? Prints JSON.

  python scripts/copy_accuracy.py HEAD_DIR [--max-new-tokens 256] [--max-prompts 10]

Decodes each workload turn plainly (greedy, as `eyas eval` does; later turns read the
earlier replies), then runs the head teacher-forced over prompt + reply with the target's
features: slot t reads x_{t+1} and predicts x_{t+2}. Each reply position is "copyable"
when prompt lookup (vLLM's n-gram rule, the eval baseline) would propose the right token
there, "other" when not. A head that copies scores far higher on copyable positions than
on the others; one that does not scores about the same on both.

Keys: copyable / other {positions, head_accuracy}, ngram {proposed, precision}, settings.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head", help="an exported head directory or an eyas checkpoint")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--workload", default="mtbench")
    ap.add_argument("--max-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    from tqdm import tqdm

    from eyas.eval.ngram import ngram_propose
    from eyas.eval.speculate import capture_aux, greedy_decode
    from eyas.eval.workloads import load_workload, render_turn
    from eyas.export.reader import load_any_head
    from eyas.target.load import load_target, stop_token_ids

    target = load_target(args.target, dtype=args.dtype, device="cpu")
    model, tokenizer = target.model, target.tokenizer
    head = load_any_head(args.head, model.get_input_embeddings().weight, dtype=model.dtype).eval()
    eos = stop_token_ids(model, tokenizer)
    prompts = load_workload(args.workload, args.max_prompts)
    counts = {"copyable": [0, 0], "other": [0, 0]}  # [head hits, positions]
    proposed = right = 0
    bar = tqdm(total=sum(len(p.turns) for p in prompts), desc="copy accuracy", unit="turn")
    for prompt in prompts:
        replies: list[str] = []
        for _turn in range(len(prompt.turns)):
            ids = render_turn(tokenizer, prompt, replies)
            reply = greedy_decode(model, ids, args.max_new_tokens, eos).tokens
            replies.append(tokenizer.decode(reply, skip_special_tokens=True))
            seq = ids + reply
            with torch.no_grad(), capture_aux(model, head.config.aux_layer_ids) as grabbed:
                model(input_ids=torch.tensor([seq]))
                aux = grabbed["aux"]
                n = len(seq) - 1
                logits, _ = head.forward_step(
                    torch.tensor([seq[1:]]),
                    head.combine_aux(aux[:, :-1]),
                    torch.arange(n)[None],
                    head.new_cache(),
                )
                pred = head.to_target_ids(logits[0].argmax(-1)).tolist()  # pred[t] is for x_{t+2}
            tokens = np.asarray(seq)
            for t in range(len(ids) - 1, len(seq) - 2):  # the predicted token x_{t+2} is in the reply
                label = seq[t + 2]
                lookup = ngram_propose(tokens[: t + 2], 1)
                copyable = lookup.size > 0 and int(lookup[0]) == label
                proposed += lookup.size > 0
                right += copyable
                key = "copyable" if copyable else "other"
                counts[key][0] += pred[t] == label
                counts[key][1] += 1
            bar.update(1)
    bar.close()
    out = {k: {"positions": c, "head_accuracy": h / c if c else None} for k, (h, c) in counts.items()}
    out["ngram"] = {"proposed": proposed, "precision": right / proposed if proposed else None}
    out["settings"] = {
        "head": args.head,
        "target": args.target,
        "workload": args.workload,
        "max_prompts": args.max_prompts,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
