"""One training step of a draft head at a real target's shape, on synthetic features: the
step a GPU node repeats for hours. Builds the head of a shipped recipe (EAGLE-3 or
P-EAGLE) over the target's published dimensions (no weights needed), then times the
recipe's step: labels from the target's LM head, the TTT / COD loss under bf16 autocast,
backward, AdamW. Prints JSON.

  python scripts/bench_head_step.py                                   # SmolLM2-135M, CPU
  python scripts/bench_head_step.py --target gpt-oss-20b --algorithm peagle   # on a GPU

Keys: tokens_per_s (real tokens per second over the timed steps), step_seconds (each
timed step), peak_memory_gb (CUDA: the allocator's peak; CPU: the process's peak RSS),
head_params, plus the settings. The first steps (torch.compile of flex attention and of
the loss) are warm-up and not timed.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

# Published config.json values (only what shapes the head and its labels).
TARGET_SHAPES = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        vocab_size=201088,
        rope_theta=150000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen3-coder-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        vocab_size=151936,
        rope_theta=10000000.0,
        rms_norm_eps=1e-6,
    ),
}
TARGET_SHAPES["gpt-oss-120b"] = {**TARGET_SHAPES["gpt-oss-20b"], "num_hidden_layers": 36}
ROOT = Path(__file__).resolve().parent.parent


def target_config(name: str):
    from transformers import AutoConfig

    shape = dict(TARGET_SHAPES[name])
    return AutoConfig.for_model(shape.pop("model_type"), **shape)


def top_ops(profiler, device_type: str, n: int) -> list[dict]:
    """The n ops with the most self time on the device (CPU time on a CPU run)."""
    key = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    events = sorted(profiler.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key[:80], "ms": round(getattr(e, key) / 1000, 2), "calls": e.count} for e in events]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGET_SHAPES), default="smollm2-135m")
    ap.add_argument("--algorithm", choices=("eagle3", "peagle"), default="eagle3")
    ap.add_argument(
        "--recipe", help="recipe for the head and train settings (default: recipes/<target>-<algorithm>.yaml)"
    )
    ap.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: min(data.max_length, 2048))"
    )
    ap.add_argument(
        "--batch-tokens", type=int, default=None, help="tokens per step (default: train.batch_tokens)"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compiles)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile one more step; JSON key profile: its N costliest ops",
    )
    args = ap.parse_args()

    from eyas.recipe import load_recipe
    from eyas.train.step_timing import build_head_step, synthetic_batch

    recipe_path = Path(args.recipe or ROOT / "recipes" / f"{args.target}-{args.algorithm}.yaml")
    recipe = load_recipe(str(recipe_path), [])
    cfg_t = target_config(args.target)
    device = torch.device(args.device)
    train_cfg = recipe.train
    seq = args.seq or min(recipe.data.max_length, 2048)
    batch_tokens = args.batch_tokens or train_cfg.batch_tokens
    b = max(1, min(batch_tokens // seq, train_cfg.max_batch_size))
    step = build_head_step(recipe, cfg_t, args.target, device, rows=b * seq)
    head_cfg, target_dtype, mixed_precision = step.head_config, step.target_dtype, step.mixed_precision
    gen = torch.Generator().manual_seed(0)
    batches = [
        synthetic_batch(b, seq, cfg_t.vocab_size, step.aux_width, cfg_t.hidden_size, device, gen)
        for _ in range(2)
    ]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    seconds, tokens, profile = [], 0, None
    # the profiled step (profiling slows it) comes after the timed ones
    n_steps = args.warmup + args.steps + (1 if args.profile else 0)
    for i in range(n_steps):
        batch = batches[i % 2]
        profiler = None
        if args.profile and i == n_steps - 1:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            profiler = torch_profile(activities=acts)
            profiler.__enter__()
        sync()
        t0 = time.perf_counter()
        n_tokens = step.run(batch)
        sync()
        if profiler is not None:
            profiler.__exit__(None, None, None)
            profile = top_ops(profiler, device.type, args.profile)
        if args.warmup <= i < args.warmup + args.steps:
            seconds.append(time.perf_counter() - t0)
            tokens += n_tokens
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        name = torch.cuda.get_device_name(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        name = f"cpu ({torch.get_num_threads()} threads)"
    print(
        json.dumps(
            {
                "target": args.target,
                "algorithm": head_cfg.algorithm,
                "recipe": str(recipe_path.relative_to(ROOT))
                if recipe_path.is_relative_to(ROOT)
                else str(recipe_path),
                "device": name,
                "seq": seq,
                "batch_size": b,
                "train_section": train_cfg.section(head_cfg.algorithm).model_dump(),
                "draft_vocab_size": head_cfg.draft_vocab_size,
                "head_params": step.head_params,
                "target_dtype": str(target_dtype).removeprefix("torch."),
                "mixed_precision": mixed_precision,
                "tokens_per_s": tokens / sum(seconds),
                "step_seconds": [round(s, 4) for s in seconds],
                "peak_memory_gb": round(peak, 3),
                "torch": torch.__version__,
                **({"profile": profile} if profile is not None else {}),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
