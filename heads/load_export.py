"""Read head directories back: the speculators and original EAGLE-3 layouts that
`heads/export.py` writes (and published heads in them), and eyas checkpoints, into an
`Eagle3Head` / `PEagleHead`. Export after import reproduces the tensors bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.export import CONFIG_NAME, WEIGHTS_NAME, ExportFormatError
from eyas.heads.io import CONFIG_NAME as EYAS_CONFIG, load_head
from eyas.heads.peagle import build_head


def detect_format(head_dir: str | Path) -> Literal["eyas", "speculators", "eagle"]:
    """Which layout a head directory holds."""
    d = Path(head_dir)
    if (d / EYAS_CONFIG).is_file():
        return "eyas"
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file():
        raise ExportFormatError(f"{d}: no {EYAS_CONFIG} or {CONFIG_NAME}; not a head directory")
    raw = read_config(cfg_path)
    if raw.get("speculators_config") is not None or "speculators_model_type" in raw:
        return "speculators"
    if any("Eagle3" in a for a in raw.get("architectures") or []):
        return "eagle"
    raise ExportFormatError(f"{cfg_path}: neither a speculators config nor an EAGLE-3 config "
                            f"(architectures {raw.get('architectures')})")


def read_config(path: str | Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ExportFormatError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ExportFormatError(f"{path}: a config must be a JSON object")
    return raw


def read_tensors(head_dir: str | Path) -> dict[str, torch.Tensor]:
    """model.safetensors (or a legacy pytorch_model.bin, read with weights_only)."""
    d = Path(head_dir)
    if (d / WEIGHTS_NAME).is_file():
        return load_file(str(d / WEIGHTS_NAME))
    legacy = d / "pytorch_model.bin"
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ExportFormatError(f"{d}: no {WEIGHTS_NAME}")


def _rope_theta(layer: dict) -> float:
    params = layer.get("rope_parameters") or {}
    return float(params.get("rope_theta", layer.get("rope_theta", 10000.0)))


def config_from_export(raw: dict, fmt: Literal["speculators", "eagle"], tensors: dict | None = None) -> DraftHeadConfig:
    """Rebuild a `DraftHeadConfig` from a serving config. Published heads lack the `eyas`
    block: the target's layer count then defaults to the largest aux id + 1, and a
    missing aux-id list (original EAGLE heads) is an error naming the file's keys."""
    layer = raw["transformer_layer_config"] if fmt == "speculators" else raw
    eyas = raw.get("eyas") or {}
    eagle = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ExportFormatError("the config names no eagle_aux_hidden_state_layer_ids; the target layers "
                                "feeding the head are unknown")
    if fmt == "speculators":
        spec = raw["speculators_config"]
        algorithm = raw["speculators_model_type"]
        k = spec["proposal_methods"][0]["speculative_tokens"]
        verifier = spec["verifier"]
        verifier_path, archs = verifier.get("name_or_path"), verifier.get("architectures")
    else:
        algorithm = eyas.get("algorithm", "peagle" if "mask_token_id" in raw else "eagle3")
        k = eyas.get("speculative_tokens", 5)
        verifier_path, archs = eyas.get("verifier_name_or_path"), eyas.get("target_architectures")
    hidden = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    vocab = layer["vocab_size"]
    return DraftHeadConfig(
        algorithm=algorithm,
        hidden_size=hidden,
        target_hidden_size=raw.get("target_hidden_size") or hidden,
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or hidden // heads,
        intermediate_size=layer["intermediate_size"],
        num_hidden_layers=layer.get("num_hidden_layers", 1),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(layer),
        max_position_embeddings=layer.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        draft_vocab_size=raw.get("draft_vocab_size") or vocab,
        aux_layer_ids=list(aux),
        target_num_layers=eyas.get("target_num_layers", max(aux) + 1),
        norm_before_residual=bool(raw.get("norm_before_residual", algorithm == "eagle3")),
        norm_before_fc=bool(raw.get("norm_before_fc", eagle.get("norm_before_fc", False))),
        fc_norm=bool(raw.get("fc_norm", layer.get("fc_norm", False))),
        norm_output=bool(raw.get("norm_output", layer.get("norm_output", False))),
        mask_token_id=raw.get("mask_token_id", raw.get("ptd_token_id")),
        speculative_tokens=k,
        target_model_type=eyas.get("target_model_type", "llama"),
        target_architectures=list(archs or ["LlamaForCausalLM"]),
        verifier_name_or_path=verifier_path,
    )


def _canonical_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.startswith("model."):  # some trainers save with the HF prefix
            name = name[len("model."):]
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[1] != "0" and parts[2] == "hidden_norm":
            continue  # built but unused by vLLM in layers >= 1; our layers have none
        out[name] = t
    return out


def load_exported_head(
    head_dir: str | Path,
    target_embed: torch.Tensor | None = None,
    device="cpu",
    dtype: torch.dtype | None = None,
) -> Eagle3Head:
    """An `Eagle3Head` / `PEagleHead` from a speculators or EAGLE-format directory.

    The head's floats take the stored dtype (or `dtype`). Without `embed_tokens.weight`
    in the file, `target_embed` [Vt, Ht] fills the frozen embedding."""
    fmt = detect_format(head_dir)
    if fmt == "eyas":
        raise ExportFormatError(f"{head_dir} is an eyas checkpoint; use load_any_head or heads.io.load_head")
    raw = read_config(Path(head_dir) / CONFIG_NAME)
    state = _canonical_names(read_tensors(head_dir))
    try:
        cfg = config_from_export(raw, fmt, state)
    except (KeyError, ValueError) as err:
        raise ExportFormatError(f"{Path(head_dir) / CONFIG_NAME}: cannot build the head config: {err}") from None
    head = build_head(cfg)
    float_dtype = dtype or (state["fc.weight"].dtype if "fc.weight" in state else torch.float32)
    head.to(float_dtype)
    has_embed = "embed_tokens.weight" in state
    if not has_embed:
        if head.trains_embedding:
            raise ExportFormatError(f"{head_dir}: this head needs its own embed_tokens.weight and the file has none")
        if target_embed is None:
            raise ValueError(f"{head_dir}: the head shares the target's embedding; pass target_embed [Vt, Ht]")
        state["embed_tokens.weight"] = target_embed.to(float_dtype)
    if not cfg.uses_vocab_map:
        state.pop("d2t", None)
        state.pop("t2d", None)
    state = {k: (v.to(float_dtype) if v.is_floating_point() else v) for k, v in state.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportFormatError(f"{head_dir}: missing tensors {sorted(missing)}, unexpected tensors {sorted(unexpected)}")
    head.embedding_in_export = has_embed
    return head.to(device)


def load_any_head(
    head_dir: str | Path,
    target_embed: torch.Tensor | None = None,
    device="cpu",
    dtype: torch.dtype | None = None,
) -> Eagle3Head:
    """Load an eyas checkpoint, a speculators export or an EAGLE-format export."""
    if detect_format(head_dir) == "eyas":
        head = load_head(head_dir, target_embed, device)
        return head.to(dtype) if dtype is not None else head
    return load_exported_head(head_dir, target_embed, device, dtype)
