"""Pick bf16 or float32 by what the device computes fast (`dtype: auto` in a recipe).

bf16 halves memory everywhere, but only some processors multiply in it natively: GPUs
from Ampere on, and x86 CPUs with AVX512-BF16 or AMX. On any other CPU torch emulates
bf16 matmuls through float32 conversions. Measured on a 2-core AVX-512 Xeon without
either extension (`scripts/bench_regenerate.py`, `scripts/bench_head_step.py`): float32
regenerated replies 2.8x and trained the SmolLM2 head 2.4x faster than bf16. So `auto`
means bf16 where it is native and float32 elsewhere.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def _cpu_has_native_bf16() -> bool:
    # Private torch probes (present since 2.1); a torch without them gets float32.
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def has_native_bf16(device: torch.device | str) -> bool:
    """True where bf16 matmuls run natively on `device` (a CUDA GPU with bf16 support, a
    CPU with AVX512-BF16 or AMX, an Apple GPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return _cpu_has_native_bf16()
    return kind == "mps"


def resolve_dtype(name: str, device: torch.device | str) -> str:
    """A recipe dtype (`auto`, `bfloat16`, `float16`, `float32`) -> the one to load in:
    `auto` becomes `bfloat16` where `has_native_bf16(device)`, else `float32`."""
    if name != "auto":
        return name
    chosen = "bfloat16" if has_native_bf16(device) else "float32"
    log.info("dtype auto -> %s on %s", chosen, torch.device(device).type)
    return chosen


def resolve_mixed_precision(name: str, device: torch.device | str) -> str:
    """A recipe `train.mixed_precision` (`auto`, `no`, `bf16`, `fp16`) -> the accelerate
    setting: `auto` becomes `bf16` where `has_native_bf16(device)`, else `no` (float32)."""
    if name != "auto":
        return name
    return "bf16" if has_native_bf16(device) else "no"
