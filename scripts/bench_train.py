"""Training throughput on SmolLM2-135M: offline (cached features) and online (target in the
loop), against the target's forward-only rate on the same batches. Prints JSON.

  python scripts/bench_train.py [--steps 5] [--ttt 3] [--draft-vocab 8192] [--seq 512]

Keys: train_tokens_per_s {offline, online} (best round), forward_tokens_per_s (best
round), flop_ratio {offline, online} (measured step time / the time the step's FLOPs
take at the target-forward FLOP rate, over all rounds, the modes taking turns batch by
batch), flop_ratio_median_paired (the median over rounds of that ratio within a round),
flop_ratio_best_of (best round / best forward round), seconds (per mode and round),
peak_rss_mb, plus the settings. The reference work: offline, TTT 3, draft vocab 8192, sequences of 512
ShareGPT tokens. Timings are noisy when other jobs share the CPU:
the script prints the load average it saw.

  python scripts/bench_train.py --algorithms eagle3,peagle [--variant NAME:key=value,...]

  python scripts/bench_train.py --seq-lens 2048,8192,32768 [--override head.sliding_window=2048]

times one training step per sample length instead (one sample of that length per step,
synthetic features at SmolLM2's shape, the quickstart recipe's head and loss with the
overrides; each length in a process of its own, so its peak memory is its own). Keys per
length: step_seconds (timed steps after `--warmup` untimed ones, default 1),
peak_memory_mb (CPU: the RSS sampled every 2 ms during the steps; CUDA: the allocator's
peak) and growth_mb (that peak over the memory held before the first step),
plus growth_mb_per_1k_tokens, which stays flat when memory grows linearly with length.

  python scripts/bench_train.py --algorithms eagle3,peagle [--variant NAME:key=value,...]

compares training algorithms instead: each is trained from its shipped SmolLM2 recipe
(recipes/smollm2-135m-<algorithm>.yaml) on the same cached-feature batches, the heads
taking turns batch by batch; `--variant` adds a head of a recipe with overrides (e.g.
`--variant peagle-4d:head.algorithm=peagle,train.peagle.num_depths=4`). Keys:
seconds_per_token {head} (best round: optimizer-step time per batch token),
ratio_to_first {head} (that over the first head's), seconds {head: per round}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
from bench_train_common import load_bench_data, recipe_of, train_step, trainable

from eyas.core.allocator import keep_freed_memory


def target_flops_per_token(model, seq: int) -> float:
    """Forward FLOPs per token of the base model: 2 x non-embedding weights + causal attention."""
    from eyas.target.load import text_config

    cfg = text_config(model.config)
    base = model.get_decoder()
    weights = sum(p.numel() for n, p in base.named_parameters() if "embed" not in n and p.dim() >= 2)
    attn = 4 * cfg.num_hidden_layers * (seq / 2) * cfg.num_attention_heads * cfg.head_dim
    return 2 * weights + attn


def train_flops_per_token(head, seq: int, ttt: int, vt: int, loss_share: float) -> float:
    """Labels (the frozen LM head over the full vocabulary) + forward/backward (x3) of `ttt`
    unrolled head steps. The labels and the head's LM head are only needed at slots that
    carry loss (`loss_share` of the tokens); the trunk and attention run at every slot."""
    c = head.config
    layer = sum(p.numel() for p in head.layers.parameters() if p.dim() >= 2)
    per_step = 2 * layer + loss_share * 2 * c.hidden_size * c.draft_vocab_size
    attn = sum(4 * (seq / 2 + k) * c.num_attention_heads * c.head_dim for k in range(ttt))
    fc = 2 * c.fc_in_features * c.hidden_size
    return loss_share * 2 * c.target_hidden_size * vt + 3 * (fc + ttt * per_step + attn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one warm-up)")
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--copy-attention-weight",
        type=float,
        default=0.0,
        help="train.eagle3.copy_attention_weight (the quickstart recipe uses 1.0)",
    )
    ap.add_argument(
        "--copy-attention-steps",
        type=int,
        default=1,
        help="train.eagle3.copy_attention_steps: TTT steps whose attention is supervised",
    )
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="the target's dtype (auto: bf16 where this CPU runs it natively, else float32)",
    )
    ap.add_argument(
        "--mixed-precision",
        default="auto",
        choices=("auto", "bf16", "no"),
        help="the head's autocast (auto: as --dtype auto)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over the batches, every mode taking its turn on each batch",
    )
    ap.add_argument(
        "--algorithms",
        default=None,
        help="compare these algorithms' training steps (comma-separated) instead of the modes",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:key=value,... one more head: a recipe (head.algorithm's) with overrides",
    )
    ap.add_argument("--seq-lens", default=None, help="comma-separated sample lengths: time one step at each")
    ap.add_argument(
        "--override", action="append", default=[], help="recipe override for --seq-lens (key=value)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps per length (--seq-lens)")
    ap.add_argument(
        "--repeat-every",
        type=int,
        default=0,
        help="--seq-lens: the synthetic tokens repeat with this period, so copy supervision has a "
        "source for every query past the first period (0: random tokens, almost no source)",
    )
    ap.add_argument("--one-length", type=int, default=None, help=argparse.SUPPRESS)  # a --seq-lens child
    args = ap.parse_args()
    keep_freed_memory()  # as every `eyas` command does
    if args.one_length:
        from bench_train_lengths import one_length

        print(json.dumps(one_length(args)))
        return
    if args.seq_lens:
        from bench_train_lengths import bench_lengths

        bench_lengths(args)
        return
    if args.algorithms:
        from bench_train_algorithms import compare_algorithms

        compare_algorithms(args)
        return
    loadavg_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)

    recipe = recipe_of(
        "eagle3",
        [
            f"train.eagle3.ttt_steps={args.ttt}",
            f"head.draft_vocab_size={args.draft_vocab}",
            f"train.eagle3.copy_attention_weight={args.copy_attention_weight}",
            f"train.eagle3.copy_attention_steps={args.copy_attention_steps}",
        ],
    )
    target, batches, freqs, bf16_autocast = load_bench_data(args)
    vt = target.vocab_size
    run = trainable(recipe, target, freqs, bf16_autocast)
    head, features = run["head"], run["features"]
    tokens = [int(b["attention_mask"].sum()) for b in batches]
    timed_tokens = sum(tokens[1:])

    from eyas.target.features import compute_features

    # the offline "cache": aux / last per batch, kept in memory
    cached = [features.complete(dict(b))[0] for b in batches]

    def timed(mode: str, b: dict) -> float:
        if mode != "forward":  # offline: the cached states; online: the target runs in the step
            return train_step(run, b)
        t0 = time.perf_counter()  # the pure target forward, without labels
        compute_features(target.model, b["input_ids"], b["attention_mask"], head.config.aux_layer_ids)
        return time.perf_counter() - t0

    modes = ["forward"] + [m for m in args.modes.split(",") if m]
    # Modes take turns batch by batch (the order rotating), so the forward that sets the
    # FLOP rate runs seconds away from the steps it predicts: this machine's speed drifts
    # by +-25% over minutes, which a mode-after-mode schedule turns into ratio noise.
    seconds: dict[str, list[float]] = {m: [0.0] * args.rounds for m in modes}
    for m in modes:  # warm-up: one batch per mode, untimed
        timed(m, cached[0] if m == "offline" else batches[0])
    turn = 0
    for r in range(args.rounds):
        for i in range(1, len(batches)):
            for mode in modes[turn % len(modes) :] + modes[: turn % len(modes)]:
                seconds[mode][r] += timed(mode, cached[i] if mode == "offline" else batches[i])
            turn += 1

    f_target = target_flops_per_token(target.model, args.seq)
    # slots whose next token is real and in the loss mask: where labels and LM-head rows are needed
    loss_share = (
        sum(
            int((b["loss_mask"][:, 1:].bool() & b["attention_mask"][:, 1:].bool()).sum()) for b in batches[1:]
        )
        / timed_tokens
    )
    f_train = train_flops_per_token(head, args.seq, args.ttt, vt, loss_share)
    best_fwd = min(seconds["forward"])
    result = {
        "settings": {
            "ttt_steps": args.ttt,
            "draft_vocab_size": args.draft_vocab,
            "seq": args.seq,
            "batch": args.batch,
            "copy_attention_weight": args.copy_attention_weight,
            "copy_attention_steps": args.copy_attention_steps,
            "timed_steps": args.steps,
            "rounds": args.rounds,
            "threads": torch.get_num_threads(),
            "loadavg_before": loadavg_before,
            "target_dtype": str(target.model.dtype).removeprefix("torch."),
            "bf16_autocast": bf16_autocast,
        },
        "train_tokens_per_s": {},
        "forward_tokens_per_s": timed_tokens / best_fwd,
        "flop_ratio": {},
        "flop_ratio_median_paired": {},
        "flop_ratio_best_of": {},
        "seconds": seconds,
    }
    for mode in modes[1:]:
        flops = f_train + (f_target if mode == "online" else 0.0)
        # the time the mode's FLOPs take at the target-forward FLOP rate of the same round
        predicted = [fwd * flops / f_target for fwd in seconds["forward"]]
        result["train_tokens_per_s"][mode] = timed_tokens / min(seconds[mode])
        result["flop_ratio"][mode] = sum(seconds[mode]) / sum(predicted)
        result["flop_ratio_median_paired"][mode] = statistics.median(
            s / p for s, p in zip(seconds[mode], predicted)
        )
        result["flop_ratio_best_of"][mode] = min(seconds[mode]) / (best_fwd * flops / f_target)
    result["flops_per_token"] = {
        "target_forward": f_target,
        "train_step_offline": f_train,
        "loss_share": loss_share,
    }
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["settings"]["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
