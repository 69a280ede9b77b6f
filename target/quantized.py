"""Quantized target checkpoints (MXFP4 GPT-OSS, FP8 releases) stay quantized, or the user
said otherwise. transformers falls back to bf16 with a warning when the kernels a format
needs are missing (MXFP4: triton and the `kernels` package); GPT-OSS-120B then takes
~234 GB instead of ~65 GB per rank and the run dies later, out of memory. So eyas checks
the kernels before loading and refuses, naming what to install, unless
`target.dequantize: true` accepts bf16; and checks after loading that the weights are
still quantized.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

log = logging.getLogger(__name__)
# Storage dtypes of quantized weights: packed FP4 blocks and their scales, FP8.
QUANTIZED_DTYPES = {torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2}


class QuantizationError(RuntimeError):
    """A quantized checkpoint would load (or has loaded) dequantized without the user's consent."""


def quant_method(config) -> str | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _triton_at_least(version: str) -> bool:
    if not _installed("triton"):
        return False
    from importlib.metadata import version as installed

    from packaging.version import Version

    try:
        return Version(installed("triton")) >= Version(version)
    except Exception:  # a triton without metadata: let transformers decide, then check
        return True


def missing_kernels(method: str, device_type: str) -> list[str]:
    """What a quantized format needs on `device_type` that this environment lacks, as pip
    requirements; [] when it can run quantized."""
    if method == "mxfp4":
        need = []
        triton = "3.4" if device_type == "cuda" else "3.5"
        if not _triton_at_least(triton):
            need.append(f"triton>={triton}")
        if not _installed("kernels"):
            need.append("kernels")
        return need
    if method in ("fp8", "fbgemm_fp8") and device_type != "cuda":
        return ["a CUDA GPU"]
    return []


def quantization_kwargs(config, device_type: str, dequantize: bool, name: str) -> dict:
    """`from_pretrained` keyword arguments for a (possibly) quantized checkpoint: none for a
    plain one; the format's own config with dequantize=True when the user accepts bf16;
    raises QuantizationError naming what to install when its kernels are missing."""
    method = quant_method(config)
    if method is None:
        return {}
    if dequantize:
        log.warning(
            "target %s: %s weights dequantized to bf16 on load (target.dequantize: true)", name, method
        )
        if method == "mxfp4":
            from transformers import Mxfp4Config

            return {"quantization_config": Mxfp4Config(dequantize=True)}
        return {}
    need = missing_kernels(method, device_type)
    if need and method == "mxfp4":
        raise QuantizationError(
            f"target {name}: its mxfp4 experts would load dequantized to bf16 (about 4x their memory) "
            f"since this environment lacks {' and '.join(need)}: pip install "
            f"{' '.join(repr(n) for n in need)}, or set target.dequantize: true to accept bf16"
        )
    if need:
        raise QuantizationError(
            f"target {name}: its {method} weights run quantized only on a CUDA GPU; set "
            "target.dequantize: true to accept bf16"
        )
    return {}


def check_still_quantized(model: torch.nn.Module, config, dequantize: bool, name: str) -> None:
    """After loading: a quantized checkpoint's weights are still stored quantized (unless
    the user accepted bf16)."""
    method = quant_method(config)
    if method is None or dequantize:
        return
    kept = any(t.dtype in QUANTIZED_DTYPES for t in (*model.parameters(), *model.buffers()))
    if not kept:
        raise QuantizationError(
            f"target {name}: its {method} checkpoint loaded dequantized (transformers fell back to bf16; "
            "its log says why): install the kernels it names, or set target.dequantize: true to accept bf16"
        )
