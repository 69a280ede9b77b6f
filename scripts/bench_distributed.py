"""Training throughput per process, 1 against 2 processes, for each distributed strategy
(one process, DDP, FSDP2, DeepSpeed ZeRO-2 / ZeRO-3) on CPU processes (gloo). Writes JSON.

  python scripts/bench_distributed.py [--recipe recipes/smollm2-135m-eagle3.yaml] [--steps 6]
      [--samples 96] [--batch-tokens 2048] [--strategies single,ddp,fsdp,zero2,zero3] [--json out.json]

Prepares and captures a small slice of the recipe's data once (no regeneration, offline
features), then launches `accelerate launch -m eyas.train` per strategy with 1 and with 2
processes and reads the run's own `train/tokens_per_s` (tokens of every rank per second)
from metrics.jsonl: the median over the steps after the first two, divided by the process
count. Each process gets `--threads` CPU threads (default: the cores / 2, so 2 processes
do not oversubscribe); on a machine shared with other jobs the numbers move with the load,
which the JSON records. No number here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from eyas.core.run_paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "single": ("single.yaml", {}),
    "ddp": ("ddp.yaml", {}),
    "fsdp": ("fsdp.yaml", {}),
    "zero2": ("deepspeed_zero2.yaml", {"DS_ACCELERATOR": "cpu"}),
    "zero3": ("deepspeed_zero3.yaml", {"DS_ACCELERATOR": "cpu"}),
}


def prepared_tree(args, root: Path) -> dict:
    """The recipe cut to a small offline run, prepared and captured under `root`."""
    from eyas.data.capture import capture
    from eyas.data.prepare import prepare
    from eyas.recipe import load_recipe

    recipe = load_recipe(
        args.recipe,
        [
            f"run_dir={root / 'base'}",
            f"data.max_samples={args.samples}",
            "data.regenerate.enabled=false",
            "data.features=offline",
        ],
    )
    prepare(recipe, progress=False)
    capture(recipe, progress=False)
    tree = recipe.model_dump(mode="json")
    tree["train"].update(
        max_steps=args.steps,
        batch_tokens=args.batch_tokens,
        grad_accum=1,
        save_every=0,
        eval_every=0,
        log_every=1,
        logger="jsonl",
        cpu_threads=args.threads,
        mixed_precision="no",
    )
    return tree


def launch(tree: dict, root: Path, strategy: str, processes: int) -> dict:
    """One run; its per-process tokens/s and wall time."""
    name = f"{strategy}-{processes}"
    run = root / name
    run.mkdir()
    for sub in ("prepared", "cache"):
        os.symlink(root / "base" / sub, run / sub)
    recipe = root / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump({**tree, "run_dir": str(run)}))
    config, env = CONFIGS[strategy]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [str(REPO / "recipes" / "accelerate" / config), "--num_processes", str(processes)]
    cmd += ["-m", "eyas.train", "--recipe", str(recipe), "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:], "wall_s": wall}
    rows = [json.loads(line) for line in RunPaths(run).metrics.read_text().splitlines()]
    rates = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r][2:]
    total = statistics.median(rates) if rates else float("nan")
    return {"tokens_per_s_per_process": total / processes, "tokens_per_s": total, "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-eagle3.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="train.batch_tokens of every process")
    ap.add_argument("--samples", type=int, default=96, help="conversations prepared and captured")
    ap.add_argument("--strategies", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    strategies = args.strategies.split(",")
    unknown = sorted(set(strategies) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown strategies {unknown}: {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="eyas-bench-dist-") as tmp:
        root = Path(tmp)
        tree = prepared_tree(args, root)
        result = {
            "recipe": args.recipe,
            "steps": args.steps,
            "batch_tokens": args.batch_tokens,
            "samples": args.samples,
            "threads_per_process": args.threads,
            "cpu_count": os.cpu_count(),
            "load_average_before": os.getloadavg(),
            "runs": {},
        }
        for strategy in strategies:
            result["runs"][strategy] = {
                str(n): launch(tree, root, strategy, n) for n in ((1,) if strategy == "single" else (1, 2))
            }
            print(strategy, json.dumps(result["runs"][strategy]), file=sys.stderr)
        result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
