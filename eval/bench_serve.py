"""Serving speed where users serve (DESIGN §6.2): the target in a real vLLM engine, plain,
with the n-gram drafter and with each head, at several K, concurrencies and temperatures.

One engine per (drafter, K), started from the engine's own Python (`eval/vllm_entry.py`,
so eyas's env never imports vLLM) on 127.0.0.1 and stopped by process group. On each
engine, every (temperature, concurrency) level sends the whole workload through the
OpenAI completions endpoint (prompt token ids rendered by eyas with the target's chat
template, streamed so time to first token is seen), `concurrency` requests in flight.
Speculative counters come from the engine's Prometheus `/metrics`, read before and after
each level. With `repeats` > 1 the engine runs every level once, then again, and the
report keeps each level's median run. Each finished level is appended to `points.jsonl`,
so a killed bench resumes at the first level it had not finished.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.core.acceptance import conditional_acceptance
from eyas.core.run_paths import RunPaths
from eyas.eval.bench_report import PLOT_NAME, build_report, format_report, plot_report, point_key  # noqa: F401
from eyas.eval.bench_settings import BenchError, BenchSettings, Drafter
from eyas.eval.engine_counters import counter_delta, read_counters
from eyas.eval.request_metrics import ENGINE_FLAG, engine_offers, per_request_fields

log = logging.getLogger(__name__)

ENTRY = Path(__file__).with_name("vllm_entry.py")
POINTS_NAME = RunPaths.BENCH_SERVE_POINTS
REPORT_NAME = RunPaths.BENCH_SERVE_REPORT


# --- the engine -------------------------------------------------------------------------


def engine_command(s: BenchSettings, spec: dict | None, per_request: bool = False) -> str:
    """The command line that serves the target, with `spec` as its speculative config and,
    with `per_request`, vLLM's per-request acceptance metrics on."""
    argv = [
        s.vllm_python,
        str(ENTRY),
        "serve",
        s.target,
        "--host",
        "127.0.0.1",
        "--port",
        str(s.port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(s.max_model_len),
        "--seed",
        str(s.seed),
        "--served-model-name",
        "target",
        "--max-num-seqs",
        str(max(max(s.concurrency), 8)),
    ]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)] + (ENGINE_FLAG if per_request else [])
    # vLLM's CPU build takes 92% of a NUMA node for its KV cache unless told; GPU builds ignore it
    env = "" if "VLLM_CPU_KVCACHE_SPACE" in os.environ else "VLLM_CPU_KVCACHE_SPACE=4 "
    return env + shlex.join(argv + list(s.engine_args))


# --- the client -------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    text: str
    spec: dict | None = None  # the engine's per-request acceptance (eval/request_metrics.py)


async def _one_request(
    http, url: str, prompt: list[int], s: BenchSettings, temperature: float, seed: int
) -> RequestResult:
    body = {
        "model": "target",
        "prompt": prompt,
        "max_tokens": s.max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, pieces, usage, spec = None, [], None, None
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:500]
            raise BenchError(f"{url}/v1/completions answered {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
                spec = (chunk.get("metrics") or {}).get("speculative_decoding")
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter()
                    pieces.append(choice["text"])
    end = time.perf_counter()
    if usage is None:
        raise BenchError(f"{url}/v1/completions streamed no usage (stream_options.include_usage)")
    return RequestResult(
        int(usage.get("prompt_tokens", len(prompt))),
        int(usage["completion_tokens"]),
        (first or end) - start,
        end - start,
        "".join(pieces),
        spec,
    )


async def run_level(
    url: str, prompts: list[list[int]], concurrency: int, s: BenchSettings, temperature: float, progress=None
) -> tuple[list[RequestResult], float]:
    """Every prompt once, `concurrency` in flight; (results in prompt order, wall seconds)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(s.request_timeout_s, connect=30.0), limits=limits
    ) as http:

        async def go(i: int, prompt: list[int]) -> RequestResult:
            async with gate:
                r = await _one_request(http, url, prompt, s, temperature, s.seed + i)
            if progress is not None:
                progress.update(1)
            return r

        start = time.perf_counter()
        results = await asyncio.gather(*(go(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def tokens_per_forward(output_tokens: int, requests: int, accepted: float) -> float:
    """τ of §6: decode tokens per target decode step, steps without a draft counted (the
    n-gram drafter proposes only after a match). Each request's first token comes from
    its prefill; every decode step yields one token plus the drafts it accepted."""
    decoded = output_tokens - requests
    steps = decoded - accepted
    return decoded / steps if steps > 0 else 1.0


def summarize_level(results: list[RequestResult], wall: float, counters: dict) -> dict:
    """Speed and acceptance of one level (DESIGN §6.2 defines each number)."""
    out_tokens = sum(r.output_tokens for r in results)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    drafts, proposed, accepted = counters["drafts"], counters["draft_tokens"], counters["accepted"]
    rates = conditional_acceptance(drafts, counters["per_position"])
    return {
        "requests": len(results),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "per_request_tok_s": statistics.fmean(
            r.output_tokens / r.latency_s for r in results if r.latency_s > 0
        ),
        "tpot_ms": 1e3 * statistics.fmean(tpot) if tpot else None,
        "ttft_ms": 1e3 * statistics.fmean(r.ttft_s for r in results),
        "ttft_p50_ms": 1e3 * statistics.median(r.ttft_s for r in results),
        # Little's law: the sequences in the engine's batch on average
        "mean_in_flight": sum(r.latency_s for r in results) / wall if wall > 0 else 0.0,
        "mean_context": statistics.fmean(r.prompt_tokens + r.output_tokens / 2 for r in results),
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted": accepted,
        "tokens_per_forward": tokens_per_forward(out_tokens, len(results), accepted),
        "tar": accepted / proposed if proposed else None,
        "per_position_acceptance": rates,
        "output_sha1": [hashlib.sha1(r.text.encode()).hexdigest()[:12] for r in results],
        **per_request_fields(results),
    }


# --- the bench --------------------------------------------------------------------------


def load_points(path: Path, fingerprint: str) -> dict[str, dict]:
    """Finished levels of an earlier run with the same settings; a damaged line (a run
    killed while writing it) is named and measured again."""
    done = {}
    if not path.is_file():
        return done
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        try:
            p = json.loads(line)
        except json.JSONDecodeError:
            log.warning(
                "%s:%d is not a JSON line (a killed run?): that level is measured again", path, lineno
            )
            continue
        if p.get("fingerprint") == fingerprint:
            key = point_key(p["drafter"], p["k"], p["temperature"], p["concurrency"], p.get("repeat", 0))
            done[key] = p
    return done


def engine_plan(s: BenchSettings) -> list[tuple[Drafter, int | None]]:
    """(drafter, K) per engine, plain first: its outputs are what the others must equal."""
    plain = [d for d in s.drafters if d.kind == "plain"] or [Drafter("plain", "plain")]
    return [(plain[0], None)] + [(d, k) for d in s.drafters if d.kind != "plain" for k in s.ks]


def run_bench(s: BenchSettings, out_dir: Path, progress: bool = True) -> dict:
    """Measure every level not already in out_dir/points.jsonl, then write the report."""
    from tqdm import tqdm

    from eyas.core.engine_process import launched_engine

    out_dir.mkdir(parents=True, exist_ok=True)
    points_path = out_dir / POINTS_NAME
    fp = s.fingerprint()
    done = load_points(points_path, fp)
    url = f"http://127.0.0.1:{s.port}"
    per_request = None  # asked of the engine's Python once, when a speculative engine starts
    # every level once, then every level again: a repeat is spread over the engine's life
    levels = [(r, t, c) for r in range(s.repeats) for t in s.temperatures for c in s.concurrency]
    for drafter, k in engine_plan(s):
        ident = drafter.identity(k)
        for key in [key for key, p in done.items() if (p["drafter"], p["k"]) == (drafter.name, k)]:
            if done[key].get("drafter_id") != ident:
                del done[key]  # measured with another head or config under this name
        todo = [(r, t, c) for r, t, c in levels if point_key(drafter.name, k, t, c, r) not in done]
        if not todo:
            continue
        spec = drafter.speculative_config(k) if k else None
        label = drafter.name + (f" K={k}" if k else "")
        if spec is not None and per_request is None:
            per_request = engine_offers(s.vllm_python)
        command = engine_command(s, spec, bool(per_request))
        log_path = out_dir / "logs" / f"engine_{drafter.name}_k{k or 0}.log"
        log.info("%s: starting the engine (log %s)", label, log_path)
        with launched_engine(command, [url], log_path, timeout_s=s.startup_timeout_s):
            warm = s.prompts[: min(4, len(s.prompts))]
            asyncio.run(run_level(url, warm, len(warm), s, 0.0))  # compile and cache warm-up, not measured
            bar = tqdm(total=len(todo) * len(s.prompts), desc=label, unit="req", disable=not progress)
            for repeat, temperature, conc in todo:
                before = read_counters(url)
                results, wall = asyncio.run(run_level(url, s.prompts, conc, s, temperature, bar))
                point = {
                    "fingerprint": fp,
                    "drafter_id": ident,
                    "drafter": drafter.name,
                    "kind": drafter.kind,
                    "k": k,
                    "temperature": temperature,
                    "concurrency": conc,
                    "repeat": repeat,
                    **summarize_level(results, wall, counter_delta(before, read_counters(url))),
                }
                with open(points_path, "a") as f:
                    f.write(json.dumps(point) + "\n")
                done[point_key(drafter.name, k, temperature, conc, repeat)] = point
            bar.close()
    wanted = {point_key(d.name, k, t, c, r) for d, k in engine_plan(s) for r, t, c in levels}
    offline = offline_results(s, out_dir) if s.offline_eval else None
    report = build_report(s, [p for key, p in done.items() if key in wanted], offline)
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    plot_report(report, out_dir)
    return report


def offline_results(s: BenchSettings, out_dir: Path) -> list[dict]:
    """eyas's offline τ on the bench's prompts, in float32 and the engine's dtype; kept in
    out_dir/offline.json and reused while the settings, the drafters and eyas's offline rule
    are the same."""
    from eyas.eval.offline_match import OFFLINE_RULE, offline_taus

    key = {
        "rule": OFFLINE_RULE,
        "fingerprint": s.fingerprint(),
        "drafters": [d.identity(k) for d in s.drafters if d.kind != "plain" for k in s.ks],
        "temperatures": s.temperatures,
    }
    path = out_dir / "offline.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["entries"]
    dtypes = ["float32"] + ([s.dtype] if s.dtype not in ("float32", "auto") else [])
    log.info("offline eval on the served prompts (%s)", ", ".join(dtypes))
    entries = offline_taus(
        s.target, s.prompts, s.drafters, s.ks, s.temperatures, s.max_tokens, dtypes, s.seed
    )
    path.write_text(json.dumps({"key": key, "entries": entries}, indent=1) + "\n")
    return entries
