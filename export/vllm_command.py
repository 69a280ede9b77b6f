"""What the engine is told to serve a head: vLLM's `--speculative-config` for an
algorithm and the `vllm serve` line that carries it (DESIGN §5)."""

from __future__ import annotations

import json
import shlex

from eyas.heads.algorithms import get_algorithm


def speculative_config(algorithm: str, model: str, k: int) -> dict:
    """vLLM's `--speculative-config` for a head of `algorithm` in `model` drafting K tokens:
    vLLM reads every EAGLE-3-shaped head with method "eagle3"; a parallel-drafting one
    also says so (DESIGN §5)."""
    spec = {"method": "eagle3", "model": str(model), "num_speculative_tokens": k}
    if get_algorithm(algorithm).parallel_drafting:
        spec["parallel_drafting"] = True
    return spec


def vllm_serve_command(target: str, spec: dict | None) -> str:
    """The `vllm serve` line for `target` with `spec` as its speculative config (None: plain)."""
    line = f"vllm serve {shlex.quote(target)}"
    return line + (f" --speculative-config {shlex.quote(json.dumps(spec))}" if spec else "")
