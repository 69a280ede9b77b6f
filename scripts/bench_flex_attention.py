"""P-EAGLE's attention on a GPU: compiled flex attention over the P-EAGLE block mask at a
target's head shape, with torch's own tile choice against the tiles eyas passes
(`eyas.heads.flex_attention.flex_kernel_options`). Prints JSON; on a machine without CUDA it
prints {"skipped": ...} (flex attention has no CPU backward).

  python scripts/bench_flex_attention.py [--target gpt-oss-20b] [--batch 8] [--seq 2048] [--num-depths 10]

Keys: elements (flattened P-EAGLE elements per sample), sparsity (% of mask blocks
skipped), and per variant (torch_default, eyas) forward_ms and forward_backward_ms (mean
of --repeats calls after one untimed call), plus max_abs_diff of the eyas variant's output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> None:
    from bench_head_step import TARGET_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGET_SHAPES), default="gpt-oss-20b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--num-depths", type=int, default=10)
    ap.add_argument("--cod-r", type=float, default=0.8)
    ap.add_argument("--cod-r-min", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs a CUDA GPU (flex attention has no CPU backward)"}))
        return

    from torch.nn.attention.flex_attention import flex_attention

    from eyas.heads.flex_attention import flex_kernel_options
    from eyas.train.masks import peagle_block_mask
    from eyas.train.peagle import cod_grid, compact

    shape = TARGET_SHAPES[args.target]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    attention_mask = torch.ones(args.batch, args.seq, dtype=torch.long)
    el = compact(
        cod_grid(
            attention_mask, args.num_depths, args.cod_r, args.cod_r_min, torch.Generator().manual_seed(0)
        ),
        args.seq,
    )
    mask = peagle_block_mask(el.anchor.cuda(), el.depth.cuda(), el.real.cuda())
    length = el.anchor.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(h):
        return torch.randn(
            args.batch,
            h,
            length,
            head_dim,
            device="cuda",
            dtype=torch.bfloat16,
            generator=gen,
            requires_grad=True,
        )

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    attend = torch.compile(flex_attention, dynamic=False)
    scale = head_dim**-0.5

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.repeats * 1000

    result = {
        "target": args.target,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "batch": args.batch,
        "seq": args.seq,
        "num_depths": args.num_depths,
        "elements": length,
        "sparsity": round(float(mask.sparsity()), 2),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    outputs = {}
    for name, options in (("torch_default", None), ("eyas", flex_kernel_options(q))):

        def forward(options=options):
            return attend(
                q, k, v, block_mask=mask, scale=scale, enable_gqa=heads != kv_heads, kernel_options=options
            )

        outputs[name] = forward().detach()
        result[name] = {
            "kernel_options": options,
            "forward_ms": round(timed(forward), 2),
            "forward_backward_ms": round(timed(lambda: forward().sum().backward()), 2),
        }
    result["eyas"]["max_abs_diff"] = float((outputs["eyas"] - outputs["torch_default"]).abs().max())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
