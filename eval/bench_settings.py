"""What `eyas bench-serve` measures with (DESIGN §6.2): the drafters (plain, n-gram, a
head directory) and the settings of one bench. The bench (eval/bench_serve.py) and its
report (eval/bench_report.py) both read these, so they live apart from either.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eyas.export.vllm_command import speculative_config


class BenchError(RuntimeError):
    """A bench that cannot run or whose engine answered wrongly; the message says which."""


@dataclass(frozen=True)
class Drafter:
    """plain (no speculation), ngram (vLLM's prompt lookup) or a head directory."""

    name: str
    kind: str  # plain | ngram | head
    path: str | None = None
    algorithm: str | None = None  # eagle3 | peagle, for heads
    num_layers: int | None = None
    draft_vocab: int | None = None
    ngram_min: int = 5
    ngram_max: int = 5

    def speculative_config(self, k: int) -> dict | None:
        """vLLM's `--speculative-config` for K draft tokens (DESIGN §5)."""
        if self.kind == "plain":
            return None
        if self.kind == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": self.ngram_min,
                "prompt_lookup_max": self.ngram_max,
            }
        return speculative_config(self.algorithm, self.path, k)

    def identity(self, k: int | None) -> str:
        """What a measured level was measured with: the speculative config and, for a head,
        the size and time of each file in its directory, so a head retrained in place (or
        another head under the same name) is measured again rather than reused."""
        key: list = [self.speculative_config(k) if k else None]
        if self.kind == "head" and self.path and Path(self.path).is_dir():
            key += sorted(
                (f.name, f.stat().st_size, f.stat().st_mtime_ns)
                for f in Path(self.path).iterdir()
                if f.is_file()
            )
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def head_drafter(name: str, path: str) -> Drafter:
    """A head directory read as vLLM will: its algorithm, layers and draft vocabulary."""
    from eyas.export.head_dir import read_head_dir

    head = read_head_dir(path)
    if head.problems:
        raise BenchError(f"head {name} ({path}): " + "; ".join(head.problems))
    f = head.fields
    return Drafter(
        name, "head", str(Path(path).resolve()), f.get("algo") or "eagle3", f.get("layers"), f.get("vd")
    )


@dataclass
class BenchSettings:
    target: str  # a local model directory
    drafters: list[Drafter]
    prompts: list[list[int]]
    workload: str = "mtbench"
    ks: list[int] = field(default_factory=lambda: [3, 5, 7])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    max_tokens: int = 128
    vllm_python: str = sys.executable
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    port: int = 18300
    engine_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 1800.0
    request_timeout_s: float = 1800.0
    seed: int = 0
    repeats: int = 1  # runs of each level; not in the fingerprint, so more can be added later
    offline_eval: bool = False  # also eyas's offline τ on the same prompts (eval/offline_match.py)

    def fingerprint(self) -> str:
        """What makes two measurements comparable; points of another setting are not reused."""
        key = {
            "target": self.target,
            "prompts": self.prompts,
            "max_tokens": self.max_tokens,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "engine_args": self.engine_args,
            "seed": self.seed,
            "python": self.vllm_python,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
