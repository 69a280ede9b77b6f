"""Time K-token drafting: P-EAGLE (one pass) against the EAGLE-3 chain (K passes).

A SmolLM2-sized head (H=576, 9 heads / 3 kv heads / head_dim 64, intermediate 1536,
Vt 49152) with a prefix of step-0 entries already in its KV cache; each timed call feeds
one newly verified slot and drafts K tokens, then the cache is cropped back. The heads
draft in turn, one call each per round, so drift of a shared machine falls on all alike.
Prints JSON: per K the median seconds of every head and `ratio_k{K}` = P-EAGLE / chain
(same number of layers), and `shipped_ratio_k{K}` for the P-EAGLE head as the recipes
ship it (`--shipped-layers`) against a 1-layer EAGLE-3 chain. Goal: ratio_kK <= 1.5 / K.

    python scripts/bench_draft.py [--device cuda] [--dtype bfloat16|float32]
                                  [--draft-vocab 32000] [--prefix 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eyas.core.allocator import keep_freed_memory
from eyas.heads.algorithms import build_head
from eyas.heads.config import DraftHeadConfig


def smollm2_head(algorithm: str, layers: int, draft_vocab: int) -> DraftHeadConfig:
    return DraftHeadConfig(
        algorithm=algorithm,
        hidden_size=576,
        target_hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        num_hidden_layers=layers,
        vocab_size=49152,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=[2, 15, 27],
        target_num_layers=30,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        mask_token_id=16 if algorithm == "peagle" else None,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def draft_timer(head, k: int, prefix: int, device: torch.device, dtype: torch.dtype):
    """A function timing one `head.draft` of k tokens after `prefix` cached step-0
    entries (seconds); the cache is cropped back after each call."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, head.config.vocab_size, (1, prefix + 1), generator=gen).to(device)
    aux = torch.randn(1, prefix + 1, head.config.fc_in_features, generator=gen).to(device, dtype)
    positions = torch.arange(prefix + 1, device=device)[None]
    cache = head.new_cache()
    head.forward_step(tokens[:, :prefix], head.combine_aux(aux[:, :prefix]), positions[:, :prefix], cache)

    @torch.inference_mode()
    def once() -> float:
        _sync(device)
        start = time.perf_counter()
        head.draft(cache, tokens[:, prefix:], aux[:, prefix:], positions[:, prefix:], k)
        _sync(device)
        elapsed = time.perf_counter() - start
        cache.crop(prefix)
        return elapsed

    return once


def time_heads(
    heads: dict, k: int, prefix: int, device, dtype, warmup: int, repeats: int, rounds: int
) -> dict:
    """Median seconds per head of a k-token draft. The heads take turns, `repeats` calls
    each per round, so drift of a shared machine falls on all of them alike."""
    timers = {name: draft_timer(h, k, prefix, device, dtype) for name, h in heads.items()}
    for timer in timers.values():
        for _ in range(warmup):
            timer()
    times = {name: [] for name in heads}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].extend(timer() for _ in range(repeats))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="the heads' dtype (bf16: what vLLM serves them in)",
    )
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument(
        "--layers", type=int, default=1, help="layers of both heads in the like-for-like comparison"
    )
    parser.add_argument(
        "--shipped-layers", type=int, default=2, help="layers of the P-EAGLE head the recipes ship"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="calls per head per round")
    parser.add_argument("--rounds", type=int, default=60, help="rounds in which every head drafts in turn")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry; output is always JSON")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as every `eyas` command does
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    heads = {
        "peagle": build_head(smollm2_head("peagle", args.layers, args.draft_vocab)),
        "chain": build_head(smollm2_head("eagle3", args.layers, args.draft_vocab)),
        "peagle_shipped": build_head(smollm2_head("peagle", args.shipped_layers, args.draft_vocab)),
        "chain_1layer": build_head(smollm2_head("eagle3", 1, args.draft_vocab)),
    }
    for head in heads.values():
        head.to(device, dtype).eval()
    out = {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "draft_vocab": args.draft_vocab,
        "prefix": args.prefix,
        "layers": args.layers,
        "shipped_layers": args.shipped_layers,
        "seconds": {},
    }
    for k in args.ks:
        secs = time_heads(heads, k, args.prefix, device, dtype, args.warmup, args.repeats, args.rounds)
        out["seconds"][f"k{k}"] = secs
        out[f"ratio_k{k}"] = secs["peagle"] / secs["chain"]
        out[f"shipped_ratio_k{k}"] = secs["peagle_shipped"] / secs["chain_1layer"]
        out[f"goal_k{k}"] = 1.5 / k
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
