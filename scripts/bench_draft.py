"""Time K-token drafting: P-EAGLE (one pass) against the EAGLE-3 chain (K passes).

Heads shaped like a target's decoder layer (`--target`: a Hub id whose published config
eyas ships, or a local model directory; default SmolLM2-135M), random weights, a prefix of
step-0 entries already in each head's KV cache; each timed call feeds one newly verified
slot per sequence and drafts K tokens, then the cache is put back. The heads draft in
turn, one call each per round, so drift of a shared machine falls on all alike. With
`--cuda-graphs` each draft is also captured once as a CUDA graph and replayed, as serving
engines run their drafters (eager timings there are mostly Python and kernel launches).

Prints JSON: per batch and K the median seconds of every head (`eager`, and `graph`),
`ratio` = P-EAGLE / chain at the same number of layers and `shipped_ratio` = the P-EAGLE
head the recipes ship (`--shipped-layers`) / a 1-layer EAGLE-3 chain (goal 1.5 / K); per
chain the seconds of one more draft pass (the slope over K). With `--hardware` the
planner's draft terms are fitted to those slopes (eval/calibrate.py,
`draft_terms_from_chains`) and its prediction of every P-EAGLE draft is set beside the
measured one (DESIGN §6.1).

    python scripts/bench_draft.py [--device cuda] [--dtype bfloat16|float32]
        [--target openai/gpt-oss-20b] [--layers 4] [--shipped-layers 4] [--batch 1 8 32]
        [--prefix 2048] [--ks 3 5 7] [--cuda-graphs] [--hardware H200|auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eyas.core.allocator import keep_freed_memory
from eyas.heads.algorithms import build_head
from eyas.heads.config import DraftHeadConfig, head_config_from_target
from eyas.target.features import default_aux_layer_ids
from eyas.target.load import SMOLLM2_HUB_ID, text_config
from eyas.target.shapes import read_config


def head_config(target: str, algorithm: str, layers: int, draft_vocab: int) -> DraftHeadConfig:
    """A head of `layers` layers shaped like one decoder layer of `target` (as `eyas train`
    sizes it); P-EAGLE's mask id is the last id of the vocabulary (any id times the same)."""
    from transformers import AutoConfig

    raw = read_config(target)
    cfg = text_config(AutoConfig.for_model(**raw))
    return head_config_from_target(
        cfg,
        aux_layer_ids=list(default_aux_layer_ids(cfg.num_hidden_layers)),
        draft_vocab_size=draft_vocab,
        algorithm=algorithm,
        num_hidden_layers=layers,
        architectures=raw.get("architectures"),
        mask_token_id=cfg.vocab_size - 1 if algorithm == "peagle" else None,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _prefilled(head, prefix: int, batch: int, device, dtype):
    """A cache holding `prefix` step-0 entries per sequence, the inputs of one draft call
    (one new verified slot per sequence) and a function putting the cache back."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, head.config.vocab_size, (batch, prefix + 1), generator=gen).to(device)
    aux = torch.randn(batch, prefix + 1, head.config.fc_in_features, generator=gen).to(device, dtype)
    positions = torch.arange(prefix + 1, device=device).expand(batch, -1)
    cache = head.new_cache()
    with torch.inference_mode():
        head.forward_step(tokens[:, :prefix], head.combine_aux(aux[:, :prefix]), positions[:, :prefix], cache)
    saved = [(list(layer.k), list(layer.v), list(layer.pos)) for layer in cache.layers]

    def restore() -> None:
        for layer, (k, v, pos) in zip(cache.layers, saved):
            layer.k, layer.v, layer.pos = list(k), list(v), list(pos)

    return cache, (tokens[:, prefix:], aux[:, prefix:], positions[:, prefix:]), restore


def eager_timer(head, k: int, prefix: int, batch: int, device, dtype):
    """A function timing one `head.draft` of k tokens (seconds)."""
    cache, inputs, restore = _prefilled(head, prefix, batch, device, dtype)

    @torch.inference_mode()
    def once() -> float:
        _sync(device)
        start = time.perf_counter()
        head.draft(cache, *inputs, k)
        _sync(device)
        elapsed = time.perf_counter() - start
        restore()
        return elapsed

    return once


def graph_timer(head, k: int, prefix: int, batch: int, device, dtype):
    """A function timing one replay of `head.draft` captured as a CUDA graph (seconds).
    The graph reads the prefix's keys where they lie and writes the new ones to its own
    pool, so every replay drafts from the same prefix."""
    cache, inputs, restore = _prefilled(head, prefix, batch, device, dtype)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(3):  # kernels chosen and buffers moved before the capture
            head.draft(cache, *inputs, k)
            restore()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        head.draft(cache, *inputs, k)
    restore()

    def once() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    once.reads = (cache, inputs, restore)  # the graph reads these tensors: they live as long as it
    return once


def time_heads(timers: dict, warmup: int, repeats: int, rounds: int) -> dict:
    """Median seconds per timer. The heads take turns, `repeats` calls each per round, so
    drift of a shared machine falls on all of them alike."""
    for timer in timers.values():
        for _ in range(warmup):
            timer()
    times = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].extend(timer() for _ in range(repeats))
    return {name: statistics.median(t) for name, t in times.items()}


def slope(ks: list[int], seconds: list[float]) -> float:
    """Least-squares seconds per extra drafted token (one more chain pass)."""
    mk, ms = statistics.fmean(ks), statistics.fmean(seconds)
    return sum((k - mk) * (s - ms) for k, s in zip(ks, seconds)) / sum((k - mk) ** 2 for k in ks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="the heads' dtype (bf16: what vLLM serves them in)",
    )
    parser.add_argument(
        "--target", default=SMOLLM2_HUB_ID, help="whose decoder layer the heads are shaped like"
    )
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--prefix", type=int, default=300, help="cached context per sequence")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences drafted together")
    parser.add_argument(
        "--layers", type=int, default=1, help="layers of both heads in the like-for-like comparison"
    )
    parser.add_argument(
        "--shipped-layers", type=int, default=2, help="layers of the P-EAGLE head the recipes ship"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--cuda-graphs", action="store_true", help="also time CUDA-graph replays")
    parser.add_argument(
        "--hardware",
        default=None,
        help="fit the planner's draft terms for this accelerator (a name; auto: the CUDA device's)",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="calls per head per round")
    parser.add_argument("--rounds", type=int, default=60, help="rounds in which every head drafts in turn")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry; output is always JSON")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as every `eyas` command does
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.cuda_graphs and device.type != "cuda":
        parser.error("--cuda-graphs needs --device cuda")

    # every (algorithm, layers) once: the like-for-like pair, the shipped P-EAGLE, a 1-layer chain
    wanted = {
        "peagle": ("peagle", args.layers),
        "chain": ("eagle3", args.layers),
        "peagle_shipped": ("peagle", args.shipped_layers),
        "chain_1layer": ("eagle3", 1),
    }
    torch.manual_seed(0)
    built = {}
    for spec in dict.fromkeys(wanted.values()):
        built[spec] = build_head(head_config(args.target, *spec, args.draft_vocab)).to(device, dtype).eval()
    name_of = {(alg, layers): f"{alg}_{layers}layer" for alg, layers in built}
    roles = {role: name_of[spec] for role, spec in wanted.items()}

    modes = ["eager"] + (["graph"] if args.cuda_graphs else [])
    make = {"eager": eager_timer, "graph": graph_timer}
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "target": args.target,
        "draft_vocab": args.draft_vocab,
        "prefix": args.prefix,
        "roles": roles,
        "heads": {name_of[s]: {"algorithm": s[0], "layers": s[1]} for s in built},
        "goal": {f"k{k}": 1.5 / k for k in args.ks},
        "results": {},
    }
    for mode in modes:
        for batch in args.batch:
            rows = {}
            for k in args.ks:
                try:
                    timers = {
                        name_of[s]: make[mode](head, k, args.prefix, batch, device, dtype)
                        for s, head in built.items()
                    }
                except RuntimeError as err:  # a capture that fails leaves the eager numbers standing
                    out.setdefault("errors", []).append(f"{mode} batch {batch} K={k}: {err}")
                    continue
                secs = time_heads(timers, args.warmup, args.repeats, args.rounds)
                del timers
                rows[f"k{k}"] = {
                    "seconds": secs,
                    "ratio": secs[roles["peagle"]] / secs[roles["chain"]],
                    "shipped_ratio": secs[roles["peagle_shipped"]] / secs[roles["chain_1layer"]],
                }
            ks = [k for k in args.ks if f"k{k}" in rows]
            chains = {
                name_of[s]: slope(ks, [rows[f"k{k}"]["seconds"][name_of[s]] for k in ks])
                for s in built
                if s[0] == "eagle3" and len(ks) > 1
            }
            measured = {"by_k": rows, "chain_pass_seconds": chains}
            out["results"].setdefault(mode, {})[f"batch{batch}"] = measured
            if args.out:  # what is measured survives a later failure
                args.out.write_text(json.dumps(out, indent=2) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.hardware == "auto":
        args.hardware = device_hardware(device)
    if args.hardware:
        out["planner"] = fit_planner(out, built, name_of, args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def device_hardware(device: torch.device) -> str | None:
    """The planner's name for the CUDA device timed (`H200` in "NVIDIA H200"), or None."""
    from eyas.eval.sizes import HARDWARE

    if device.type != "cuda":
        return None
    card = torch.cuda.get_device_name(device)
    return next((name for name in HARDWARE if name in card), None)


def fit_planner(out: dict, built: dict, name_of: dict, args) -> dict:
    """The planner's draft terms fitted to the measured chain slopes at each batch (the last
    mode measured: graphs when timed), and its P-EAGLE draft times beside the measured."""
    from eyas.eval.calibrate import draft_terms_from_chains
    from eyas.eval.planner import draft_time
    from eyas.eval.sizes import head_size, load_hardware, target_size_from_config, with_overrides

    mode = list(out["results"])[-1]
    target = target_size_from_config(read_config(args.target), args.target)
    sizes = {name_of[s]: head_size(target, s[0], s[1], args.draft_vocab) for s in built}
    hw = load_hardware(args.hardware)
    fits = {}
    for batch_key, res in out["results"][mode].items():
        batch = int(batch_key.removeprefix("batch"))
        chains = {sizes[n]: sec for n, sec in res["chain_pass_seconds"].items()}
        if not chains:
            continue
        terms = draft_terms_from_chains(hw, chains, batch, args.prefix)
        fitted = with_overrides(hw, **terms)
        predicted = {
            f"k{k}": {n: draft_time(fitted, sizes[n], batch, k, args.prefix, drafted=0) for n in sizes}
            for k in args.ks
        }
        fits[batch_key] = {"terms": terms, "predicted_seconds": predicted}
    return {"hardware": args.hardware, "mode": mode, "fits": fits}


if __name__ == "__main__":
    raise SystemExit(main())
