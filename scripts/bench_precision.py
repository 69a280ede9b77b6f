"""Benchmark what `dtype: auto` decides from on a CPU: one MLP projection plus one LM-head
multiply of a model's shapes (eyas/precision.py `time_matmuls`) in bf16 and float32, at
the row counts the stages work with (1: a decode step of a single sequence, 6: an eval
verify step at K=5, 256: a regeneration batch or a training batch's tokens).

It times directly and neither reads nor writes the verdict cache. Prints one JSON object:
  cpu, torch, threads, bf16_flags   the machine (bf16_flags: what torch's probes report)
  shapes                            hidden / intermediate / vocab timed
  rows                              {rows: {"bfloat16_ms", "float32_ms", "bf16_speedup", "auto"}}

usage: python scripts/bench_precision.py [--target smollm2-135m] [--rows 1,6,256] [--threads N]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m", help="a target whose config gives the shapes")
    p.add_argument("--rows", default="1,6,256")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seconds", type=float, default=0.5, help="timing per dtype and row count")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from eyas.core import precision
    from eyas.target.load import load_target_config

    config = load_target_config(args.target)
    out = {
        "cpu": precision.cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bf16_flags": {
            name: bool(getattr(torch.cpu, name, lambda: False)())
            for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        },
        "rows": {},
    }
    for rows in (int(r) for r in args.rows.split(",")):
        shapes = precision.shapes_of_config(config, rows)
        out["shapes"] = {k: v for k, v in vars(shapes.timed()).items() if k != "rows"}
        bf16 = precision.time_matmuls(torch.bfloat16, shapes, args.seconds)
        fp32 = precision.time_matmuls(torch.float32, shapes, args.seconds)
        out["rows"][rows] = {
            "bfloat16_ms": round(bf16 * 1e3, 3),
            "float32_ms": round(fp32 * 1e3, 3),
            "bf16_speedup": round(fp32 / bf16, 2),
            "auto": "bfloat16" if bf16 < fp32 else "float32",
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
