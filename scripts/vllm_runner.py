"""Run one vLLM engine for scripts/vllm_check.py. Runs inside .venv-vllm, never in eyas's venv.

  .venv-vllm/bin/python scripts/vllm_runner.py JOB.json OUT.json

JOB.json:
  {"mode": "generate" | "serve",
   "model": target dir (generate) or head dir (serve: `vllm serve DIR`),
   "speculative_config": {...} or null (plain greedy), "dtype": "float32",
   "max_model_len": 1024, "prompts": [[token ids], ...], "max_tokens": 48, "ignore_eos": true,
   "port": 18123, "timeout_s": 900}
OUT.json (generate): {"ok", "outputs": [[token ids], ...], "texts", "metrics": {"drafts",
  "draft_tokens", "accepted", "accepted_per_pos": [K]}, "startup_s", "generate_s"}
OUT.json (serve): {"ok", "completion": text, "startup_s", "log_tail"}
On failure: {"ok": false, "error": message, "traceback"}.

vLLM starts worker processes, hence the `__main__` guard; one engine per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_metrics(llm) -> dict:
    """Counters of speculative decoding summed over the engine's lifetime."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            out[SPEC_METRICS[m.name]] += int(m.value)
        elif m.name == PER_POS_METRIC:
            values = [int(v) for v in m.values]
            prev = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, values)] if prev else values
    return out


def run_generate(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=job["model"],
        tokenizer=job.get("tokenizer") or job["model"],
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 1024),
        speculative_config=job.get("speculative_config"),
        disable_log_stats=False,
        seed=0,
    )
    t1 = time.time()
    params = SamplingParams(
        temperature=0.0, max_tokens=job.get("max_tokens", 48), ignore_eos=bool(job.get("ignore_eos", True))
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    results = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.time()
    return {
        "ok": True,
        "outputs": [list(r.outputs[0].token_ids) for r in results],
        "texts": [r.outputs[0].text for r in results],
        "metrics": spec_metrics(llm),
        "startup_s": round(t1 - t0, 1),
        "generate_s": round(t2 - t1, 1),
    }


def _post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def run_serve(job: dict) -> dict:
    """`vllm serve DIR` on 127.0.0.1, one OpenAI-style completion, then shut down."""
    port = int(job.get("port", 18123))
    base = f"http://127.0.0.1:{port}"
    log_path = Path(job.get("log", "vllm_serve.log"))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--vllm-cli",
        "serve",
        job["model"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        job.get("dtype", "float32"),
        "--enforce-eager",
        "--max-model-len",
        str(job.get("max_model_len", 1024)),
        "--served-model-name",
        "head",
    ]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"),
        )
    try:
        deadline = t0 + float(job.get("timeout_s", 900))
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                raise TimeoutError("vllm serve did not become ready in time")
            time.sleep(2)
        startup = time.time() - t0
        body = {
            "model": "head",
            "prompt": job.get("prompt", "The capital of France is"),
            "max_tokens": job.get("max_tokens", 16),
            "temperature": 0.0,
        }
        reply = _post_json(base + "/v1/completions", body, timeout=300)
        return {
            "ok": True,
            "completion": reply["choices"][0]["text"],
            "usage": reply.get("usage"),
            "startup_s": round(startup, 1),
            "command": cmd,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def local_serve_command(
    model_dir: str, port: int, dtype: str = "float32", max_model_len: int = 1024, eager: bool = True
) -> str:
    """The `data.regenerate.launch` line that serves `model_dir` on 127.0.0.1 from
    .venv-vllm's CPU build (2 GiB KV cache: by default it asks for 92% of a NUMA node)."""
    root = Path(__file__).resolve().parent.parent
    return (
        f"VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 {root / '.venv-vllm' / 'bin' / 'python'} "
        f"{Path(__file__).resolve()} --vllm-cli serve {model_dir} --host 127.0.0.1 --port {port} "
        f"--dtype {dtype} --max-model-len {max_model_len} --seed 0" + (" --enforce-eager" if eager else "")
    )


def vllm_cli(argv: list[str]) -> int:
    """The `vllm` command line, through eyas's launcher (eval/vllm_entry.py), which also
    serves `eyas bench-serve`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
    from vllm_entry import main as entry_main

    return entry_main(argv)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--vllm-cli":
        return vllm_cli(argv[1:])
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    try:
        result = run_serve(job) if job.get("mode") == "serve" else run_generate(job)
    except Exception as err:  # the orchestrator reports it next to the head's name
        result = {
            "ok": False,
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()[-6000:],
        }
    Path(argv[1]).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
