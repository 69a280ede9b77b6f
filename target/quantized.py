"""Quantized target checkpoints (MXFP4 GPT-OSS, FP8 releases) stay quantized, or the user
said otherwise. transformers falls back to bf16 with a warning when the kernels a format
needs are missing (MXFP4: triton and the `kernels` package); GPT-OSS-120B then takes
~234 GB instead of ~65 GB per rank and the run dies later, out of memory. So eyas checks
the kernels before loading and refuses, naming what to install, unless
`target.dequantize: true` accepts bf16; and checks after loading that the weights are
still quantized. A load that reads no decoder layer (a trainer fed states by a cache) reads
no quantized weight, so it needs no kernel and is never refused. transformers fetches the
MXFP4 kernel from the Hugging Face Hub at load; a failed fetch (an offline GPU node) is
reported as such, with the remedies, instead of the kernels package's own message.
"""

from __future__ import annotations

import importlib.util
import logging
import re

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


def quantization_kwargs(
    config, device_type: str, dequantize: bool, name: str, layers_read: bool = True
) -> dict:
    """`from_pretrained` keyword arguments for a (possibly) quantized checkpoint: none for a
    plain one; the format's own config with dequantize=True when the user accepts bf16;
    raises QuantizationError naming what to install when its kernels are missing.
    `layers_read=False` (no decoder layer is built, so no quantized weight is read): never
    refused, and MXFP4 is told to dequantize, which is the one way transformers skips
    fetching its kernel."""
    method = quant_method(config)
    if method is None:
        return {}
    if dequantize or not layers_read:
        if layers_read:  # the user accepted bf16; with no layer read nothing is dequantized
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


def _raised_by_hub_kernels(err: BaseException) -> bool:
    """Whether `err` (or an exception it chains) was raised while fetching a kernel from the
    Hub: a frame of the `kernels` package or of transformers' hub_kernels."""
    seen, visited = err, set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        tb = seen.__traceback__
        while tb is not None:
            module = tb.tb_frame.f_globals.get("__name__", "")
            if module.startswith("kernels.") or module == "transformers.integrations.hub_kernels":
                return True
            tb = tb.tb_next
        seen = seen.__cause__ or seen.__context__
    return False


def kernel_fetch_error(err: BaseException, config, name: str) -> QuantizationError | None:
    """The error to raise for a quantized load that failed fetching its kernel from the Hub
    (None: `err` is something else). The kernels package blames publisher trust when it
    cannot reach the Hub at all; trusting remote code would not fix that, so the message
    says what would."""
    method = quant_method(config)
    if method is None or not _raised_by_hub_kernels(err):
        return None
    repo = re.search(r"'([\w.-]+/[\w.-]+)'", str(err))
    kernel = f"the kernel {repo.group(1)}" if repo else "its kernel"
    return QuantizationError(
        f"target {name}: transformers loads its {method} weights quantized with {kernel}, fetched "
        f"from the Hugging Face Hub, and the fetch failed: {err} "
        "Where the Hub cannot be reached, load the target once on a machine that reaches it (the "
        "kernel lands in the Hugging Face cache, HF_HOME), copy that cache here and set "
        "HF_HUB_OFFLINE=1; or set target.dequantize: true to load them as bf16 (their bf16 size "
        "in memory). Trusting remote code does not help an unreachable Hub."
    )


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
