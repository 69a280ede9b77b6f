"""A target's shape without its weights: its config.json (a local directory, the Hugging
Face cache, or the published config shipped for the GPU recipes' targets) built on the
meta device, its parameters counted by kind, and the bytes its weights take as they will
load (a quantized checkpoint kept quantized, or dequantized to bf16). `eyas preflight`
sizes a recipe from this (DESIGN §2.9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Bytes per weight of a quantized checkpoint's quantized tensors, as it stays on the GPU:
# MXFP4 is 4 bits plus an 8-bit scale per 32 values; FP8 one byte (a scale per row is noise).
QUANTIZED_BYTES = {"mxfp4": 4.25 / 8, "fp8": 1.0}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
CONFIGS_DIR = Path(__file__).parent / "configs"


class ShapeError(ValueError):
    """No config.json could be found for a target, offline."""


def packaged_config(name_or_path: str) -> Path | None:
    """The published config.json shipped for a Hub id (`ORG--NAME.json`), or None."""
    path = CONFIGS_DIR / (name_or_path.replace("/", "--") + ".json")
    return path if "/" in name_or_path and path.is_file() else None


def config_file(name_or_path: str, revision: str | None = None) -> Path:
    """Where a target's config.json is read from: a local directory, else the Hugging Face
    cache, else the published copy shipped with eyas, else the Hub (config.json alone)."""
    from eyas.target.load import SMOLLM2_ALIAS, SMOLLM2_HUB_ID, converted_smollm2_dir

    if name_or_path == SMOLLM2_ALIAS:  # its converted copy when there is one, else the published config
        converted = converted_smollm2_dir() / "config.json"
        return (
            converted if converted.is_file() else CONFIGS_DIR / (SMOLLM2_HUB_ID.replace("/", "--") + ".json")
        )
    local = Path(name_or_path)
    if (local / "config.json").is_file():
        return local / "config.json"
    if "/" in name_or_path and not local.exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        if isinstance(cached, str):
            return Path(cached)
    shipped = packaged_config(name_or_path)
    if shipped is not None:
        return shipped
    if "/" in name_or_path and not local.exists():  # the Hub, unless offline: one small file
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(name_or_path, "config.json", revision=revision))
        except Exception:  # offline, gated or missing: said below
            pass
    raise ShapeError(
        f"target {name_or_path!r}: no config.json in a local directory, the Hugging Face cache or the "
        f"configs shipped with eyas ({', '.join(sorted(p.stem for p in CONFIGS_DIR.glob('*.json')))}); "
        f"download it (`hf download {name_or_path} config.json`) or name a local directory"
    )


@dataclass(frozen=True)
class TargetShape:
    """What sizing a run needs of a target. Parameters are counted on the meta device."""

    name: str
    config: dict  # the config.json as read (the text config for a multimodal one)
    model_type: str
    total_params: int
    quantizable_params: int  # weights a quantized checkpoint stores quantized (the experts')
    embedding_params: int  # input embedding + LM head
    quant_method: str | None  # "mxfp4", "fp8", or None

    def weight_bytes(self, dtype: str = "bfloat16", dequantize: bool = False) -> float:
        """The weights in memory as they load: quantized tensors kept (unless `dequantize`),
        the rest in `dtype`."""
        unit = _DTYPE_BYTES[dtype]
        if self.quant_method in QUANTIZED_BYTES and not dequantize:
            rest = self.total_params - self.quantizable_params
            return rest * unit + self.quantizable_params * QUANTIZED_BYTES[self.quant_method]
        return self.total_params * unit


def read_config(name_or_path: str, revision: str | None = None) -> dict:
    path = config_file(name_or_path, revision)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ShapeError(f"{path}: not a readable config.json ({err})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ShapeError(f"{path}: a config.json names its model_type")
    return raw


def target_shape(
    name_or_path: str, revision: str | None = None, trust_remote_code: bool = False
) -> TargetShape:
    """The target built from its config.json on the meta device (no weights, seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config(name_or_path, revision)
    try:
        cfg = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as err:  # a model_type this transformers does not know
        first = str(err).split(". ")[0][:160]
        raise ShapeError(
            f"target {name_or_path!r}: cannot build its {raw['model_type']} config ({first})"
        ) from None
    total = experts = embed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        # Quantized checkpoints (MXFP4 GPT-OSS, FP8 releases) store the experts' matrices
        # quantized; biases, attention, router and embeddings stay in bf16.
        if ".experts." in name and not name.endswith("bias"):
            experts += p.numel()
        if "embed_tokens" in name or "lm_head" in name:
            embed += p.numel()
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    text = raw.get("text_config", raw)
    if quant == "fp8":  # every linear weight but the embeddings and the LM head
        experts = total - embed - _norm_params(model)
    return TargetShape(name_or_path, text, raw["model_type"], total, experts, embed, quant)


def _norm_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith("bias"))
