"""`scripts/bench_train.py --seq-lens`: one training step per sample length, each length
in a process of its own (a CPU's peak RSS is per process). See that script's docstring."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
from bench_train_common import recipe_of

BENCH_TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_train.py")


def one_length(args) -> dict:
    """One process, one length: build the step, one warm-up step, `args.steps` timed ones."""
    from bench_head_step import target_config

    from eyas.train.step_timing import build_head_step, synthetic_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.one_length
    recipe = recipe_of("eagle3", [f"train.eagle3.ttt_steps={args.ttt}", *args.override])
    cfg_t = target_config("smollm2-135m")
    device = torch.device(args.device)
    step = build_head_step(recipe, cfg_t, "smollm2-135m", device, rows=n)
    gen = torch.Generator().manual_seed(0)
    batch = synthetic_batch(1, n, cfg_t.vocab_size, step.aux_width, cfg_t.hidden_size, device, gen, [n])
    if args.repeat_every:
        period = batch["input_ids"][:, : args.repeat_every]
        batch["input_ids"] = period.repeat(1, -(-n // args.repeat_every))[:, :n]

    import threading

    import psutil

    # CPU: the RSS sampled every 2 ms while the steps run (the process's own peak RSS is
    # mostly the setup's); CUDA: the allocator's peak
    proc, samples, done = psutil.Process(), [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(proc.memory_info().rss)
            done.wait(0.002)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 2**20
    else:
        before = proc.memory_info().rss / 2**20
        threading.Thread(target=sample, daemon=True).start()
    seconds = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step.run(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            seconds.append(round(time.perf_counter() - t0, 3))
    done.set()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else max(samples) / 2**20
    return {
        "seq": n,
        "step_seconds": seconds,
        "tokens_per_s": n / statistics.median(seconds),
        "peak_memory_mb": round(peak, 1),
        "growth_mb": round(peak - before, 1),
    }


def bench_lengths(args) -> None:
    """`--seq-lens`: each length in a child process (a CPU's peak RSS is per process)."""
    import subprocess

    lengths = [int(x) for x in args.seq_lens.split(",") if x]
    base = [sys.executable, BENCH_TRAIN, "--steps", str(args.steps), "--ttt", str(args.ttt)]
    base += ["--warmup", str(args.warmup), "--repeat-every", str(args.repeat_every)]
    base += ["--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
    base += [f"--override={o}" for o in args.override]
    loadavg_before = os.getloadavg()[0]
    results = []
    for n in lengths:
        done = subprocess.run([*base, "--one-length", str(n)], capture_output=True, text=True)
        if done.returncode:
            results.append({"seq": n, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["growth_mb_per_1k_tokens"] = round(1024 * row["growth_mb"] / n, 2)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # each length as it finishes
    device = (
        torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    )
    print(
        json.dumps(
            {
                "settings": {
                    "recipe": "recipes/smollm2-135m-eagle3.yaml",
                    "overrides": [f"train.eagle3.ttt_steps={args.ttt}", *args.override],
                    "repeat_every": args.repeat_every,
                    "timed_steps": args.steps,
                    "warmup_steps": args.warmup,
                    "device": device,
                    "loadavg_before": loadavg_before,
                    "loadavg_after": os.getloadavg()[0],
                    "torch": torch.__version__,
                },
                "lengths": results,
            },
            indent=1,
        )
    )
