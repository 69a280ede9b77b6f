"""Benchmark reply regeneration on SmolLM2-135M: the hf backend (`decode_replies_hf` in
data/decode.py, eyas's in-process decoder) by batch size, and the server backend
(data/regenerate_server.py against a real `vllm serve` from .venv-vllm) by concurrency,
on the same prompts, the hf sizes first (no engine running beside them).

ShareGPT first prompts of at most --max-prompt-tokens tokens, sorted by token length and
cut into batches as `eyas prepare` does, each regenerated greedily to --max-new-tokens.
The same prompts run at every batch size, the sizes in turn for --rounds rounds (the best
round counts, so a noisy neighbour slows one round, not one size). `--states both` runs
every size also keeping the target's states of the fed tokens (`data.regenerate.keep_states`,
what `eyas capture` then copies), as the variant "<size>+states".

`--backend server` starts `vllm serve` (scripts/vllm_runner.py in .venv-vllm, float32 or
bf16 as --dtype, 2 GiB KV cache) once, outside the timing, or uses a running one given by
--server-url; each concurrency then regenerates every prompt through `eyas`'s server path
(one conversation per prompt, one turn). Both backends count reply tokens the same way:
the stored reply text tokenized again.

Prints one JSON object. Keys other tools read:
  reply_tokens_per_s   {variant: reply tokens per second}, best round; variants are the hf
                       batch sizes ("256", "256+states") and "server@<concurrency>"
  replies_per_s        {variant: replies per second}
  speedup_over_first   {variant: reply_tokens_per_s / that of the first variant}
  states_cost          {batch_size: seconds with states / without - 1} (--states both)

usage: python scripts/bench_regenerate.py [--backend hf|server|both] [--prompts 256]
           [--batch-sizes 64,128,256] [--concurrency 16,64] [--rounds 2] [--states off|on|both]
           [--server-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from eyas.core.allocator import keep_freed_memory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch-sizes", default="64,128,256")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--states",
        choices=["off", "on", "both"],
        default="off",
        help="keep the fed tokens' states (data.regenerate.keep_states): off, on, or both variants",
    )
    ap.add_argument("--backend", choices=["hf", "server", "both"], default="hf")
    ap.add_argument("--concurrency", default="16,64", help="server backend: requests in flight, one run each")
    ap.add_argument("--server-url", help="a running OpenAI-compatible server instead of starting vllm serve")
    ap.add_argument(
        "--engine-log", default=None, help="where the started engine writes (default: a temp file)"
    )
    args = ap.parse_args()
    keep_freed_memory()  # as every `eyas` command does
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.states]
    sizes = (
        [(int(s), keep) for s in args.batch_sizes.split(",") for keep in modes]
        if args.backend != "server"
        else []
    )
    concurrencies = [int(c) for c in args.concurrency.split(",")] if args.backend != "hf" else []

    from eyas.data.conversations import read_conversations
    from eyas.data.decode import decode_replies_hf
    from eyas.data.fed_states import fed_state_layer_ids
    from eyas.data.regenerate import before_first_reply
    from eyas.data.templates import TemplateError, prompt_ids
    from eyas.target.features import default_aux_layer_ids
    from eyas.target.load import load_target

    target = load_target(args.target, dtype=args.dtype, device="cpu")
    convs, _ = read_conversations(["sharegpt"], max_samples=args.prompts * 3)
    prompts, firsts = [], []
    for conv in convs:
        first = before_first_reply(conv)
        try:
            p = prompt_ids(target.tokenizer, first)
        except TemplateError:
            continue
        if first and len(p) <= args.max_prompt_tokens:
            prompts.append(p)
            firsts.append(first)
        if len(prompts) == args.prompts:
            break
    prompts.sort(key=len)
    layer_ids = fed_state_layer_ids(default_aux_layer_ids(target.num_layers), target.num_layers)

    def count(texts):
        return sum(len(target.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)

    variants = [(f"{bs}+states" if keep else str(bs)) for bs, keep in sizes] + [
        f"server@{c}" for c in concurrencies
    ]
    seconds = {v: [] for v in variants}
    reply_tokens, replies_n = {}, {}
    loadavg_before = os.getloadavg()[0]
    # the hf sizes first, with no engine up: an idle vLLM engine still takes CPU time
    for _ in range(args.rounds):
        for bs, keep in sizes:
            start, texts = time.perf_counter(), []
            for i in range(0, len(prompts), bs):
                replies = decode_replies_hf(
                    target.model,
                    target.tokenizer,
                    prompts[i : i + bs],
                    args.max_new_tokens,
                    0.0,
                    1.0,
                    state_layer_ids=layer_ids if keep else None,
                )
                texts += [r.text for r in replies]
            v = f"{bs}+states" if keep else str(bs)
            seconds[v].append(time.perf_counter() - start)
            reply_tokens[v], replies_n[v] = count(texts), sum(bool(t) for t in texts)
    with _server(args, target.path) as url:
        for _ in range(args.rounds):
            for c in concurrencies:
                v = f"server@{c}"
                start = time.perf_counter()
                texts = _regenerate_through_server(url, c, firsts, target.tokenizer, args.max_new_tokens)
                seconds[v].append(time.perf_counter() - start)
                reply_tokens[v], replies_n[v] = count(texts), sum(bool(t) for t in texts)
    rate = {v: reply_tokens[v] / min(seconds[v]) for v in variants}
    states_cost = {
        str(bs): round(min(seconds[f"{bs}+states"]) / min(seconds[str(bs)]) - 1, 3)
        for bs, keep in sizes
        if keep and str(bs) in seconds
    }
    print(
        json.dumps(
            {
                "settings": {
                    "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens,
                    "max_prompt_tokens": args.max_prompt_tokens,
                    "dtype": args.dtype,
                    "rounds": args.rounds,
                    "threads": torch.get_num_threads(),
                    "loadavg_before": loadavg_before,
                    "server": args.server_url or ("vllm serve (.venv-vllm)" if concurrencies else None),
                },
                "reply_tokens": reply_tokens,
                "reply_tokens_per_s": {v: round(rate[v], 1) for v in variants},
                "replies_per_s": {v: round(replies_n[v] / min(seconds[v]), 2) for v in variants},
                "speedup_over_first": {v: round(rate[v] / rate[variants[0]], 3) for v in variants},
                "seconds": {v: [round(s, 2) for s in seconds[v]] for v in variants},
                **({"states_cost": states_cost} if states_cost else {}),
            },
            indent=2,
        )
    )
    return 0


def _server(args, model_dir: str):
    """The base URL to regenerate through: --server-url as it is, else a `vllm serve` of
    the target started here (its start-up outside the timing) and stopped at the end."""
    from contextlib import contextmanager

    from eyas.core.engine_process import launched_engine

    if args.backend == "hf":
        return nullcontext(None)
    if args.server_url:
        return nullcontext(args.server_url)
    root = Path(__file__).resolve().parent.parent
    vllm_py = root / ".venv-vllm" / "bin" / "python"
    if not vllm_py.is_file():
        sys.exit(
            "--backend server starts vllm serve from .venv-vllm: run scripts/setup_vllm_env.sh, "
            "or pass --server-url of a running server"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    dtype = {"bfloat16": "bfloat16", "bf16": "bfloat16"}.get(args.dtype, "float32")
    sys.path.insert(0, str(root / "scripts"))
    from vllm_runner import local_serve_command

    command = local_serve_command(
        model_dir, port, dtype, args.max_prompt_tokens + args.max_new_tokens + 64, eager=False
    )
    log_path = Path(args.engine_log or tempfile.mktemp(prefix="bench-regenerate-engine-", suffix=".log"))

    @contextmanager
    def started():
        print(f"starting vllm serve (log: {log_path})", file=sys.stderr)
        with launched_engine(command, [url], log_path, timeout_s=900):
            yield url

    return started()


def _regenerate_through_server(
    url: str, concurrency: int, firsts: list[list[dict]], tokenizer, max_new_tokens: int
) -> list[str]:
    """Every first prompt through eyas's server backend, as `eyas prepare` sends them;
    returns the stored reply texts ("" where none came)."""
    from eyas.data.regenerate import regenerate
    from eyas.data.regenerate_settings import RegenerationSettings, ServerSettings

    conversations = [first + [{"role": "assistant", "content": ""}] for first in firsts]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerSettings(urls=[url], concurrency=concurrency)
        out = regenerate(
            conversations,
            tokenizer,
            Path(tmp) / "regenerated.jsonl",
            RegenerationSettings(
                backend="server", max_new_tokens=max_new_tokens, server=server, progress=False
            ),
        )
    return [c[-1]["content"] if c else "" for c in out]


if __name__ == "__main__":
    sys.exit(main())
