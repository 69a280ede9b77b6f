"""Write a head in the layouts vLLM serves (DESIGN §5); `export/reader.py` reads
such directories (and published heads) back.

Two layouts:
- `speculators`: config.json with `speculators_model_type` / `transformer_layer_config` /
  `speculators_config` (no top-level `model_type`) + model.safetensors (names without a
  `model.` prefix). `vllm serve DIR` and `--speculative-config '{"model": DIR}'` read it.
- `eagle`: the original EAGLE-3 layout: a flat llama config with
  `architectures: ["LlamaForCausalLMEagle3"]` + model.safetensors; a one-layer head names
  its layer `midlayer.*` (vLLM maps it to `layers.0.*`).

The config's schema (both layouts) is `export/serving_config.py`. Besides what vLLM reads,
config.json carries an `eyas` block (target layer count, family, whether the embedding
ships) so the validator can check aux ids against the target and an import rebuilds the
exact `DraftHeadConfig`; vLLM ignores unknown top-level keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from eyas.export.serving_build import build_eagle, build_layer, build_speculators
from eyas.export.vllm_command import speculative_config, vllm_serve_command
from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.io import CONFIG_NAME as EYAS_CONFIG
from eyas.heads.io import WEIGHTS_NAME as EYAS_WEIGHTS
from eyas.heads.io import head_state_dict
from eyas.heads.peagle import with_mask_row

ExportFormat = Literal["speculators", "eagle"]
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportFormatError(ValueError):
    """A directory that is not a head in a known layout; the message names the file."""


# --- config ---------------------------------------------------------------------------
# The schema lives in export/serving_config.py, its builders in export/serving_build.py
# (DESIGN §5); these dicts are what config.json holds.


def transformer_layer_config(cfg: DraftHeadConfig) -> dict:
    """The head as a complete llama config (`vocab_size` = the target's vocabulary)."""
    return build_layer(cfg).model_dump(mode="json")


def speculators_config_dict(
    cfg: DraftHeadConfig, verifier: str | None = None, ships_embedding: bool = False
) -> dict:
    """config.json of the speculators layout (DESIGN §5)."""
    return build_speculators(cfg, verifier, ships_embedding).to_dict()


def eagle_config_dict(
    cfg: DraftHeadConfig, verifier: str | None = None, ships_embedding: bool = False
) -> dict:
    """config.json of the original EAGLE-3 layout (a flat llama config)."""
    return build_eagle(cfg, verifier, ships_embedding).to_dict()


# --- tensors --------------------------------------------------------------------------


def export_tensors(
    cfg: DraftHeadConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None = torch.bfloat16,
    fmt: ExportFormat = "speculators",
) -> dict[str, torch.Tensor]:
    """Serving tensors from a head state dict: floats cast to `dtype` (None keeps them),
    `d2t` int64, `t2d` bool; `d2t`/`t2d` dropped when Vd == Vt; `layers.0.` renamed
    `midlayer.` for a one-layer head in the EAGLE layout."""
    out = {}
    for name, t in state.items():
        if name in ("d2t", "t2d") and not cfg.uses_vocab_map:
            continue
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        if fmt == "eagle" and cfg.num_hidden_layers == 1 and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        out[name] = t.detach().cpu().contiguous()
    return out


def write_export(
    cfg: DraftHeadConfig,
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    fmt: ExportFormat = "speculators",
    dtype: torch.dtype | None = torch.bfloat16,
    verifier: str | None = None,
) -> Path:
    """Write config.json + model.safetensors for a head given as (config, state dict).
    `state` holds `embed_tokens.weight` only when the embedding ships (see DESIGN §5)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.mask_token_id is not None:
        state = with_mask_row(state, cfg.mask_token_id)
    ships_embedding = "embed_tokens.weight" in state
    if cfg.trains_embedding or cfg.hidden_size != cfg.target_hidden_size:
        if not ships_embedding:
            raise ValueError(
                "this head's embedding must ship (P-EAGLE, or H != Ht) but the state has no "
                "embed_tokens.weight"
            )
    make = speculators_config_dict if fmt == "speculators" else eagle_config_dict
    config = make(cfg, verifier, ships_embedding)
    tensors = export_tensors(cfg, state, dtype, fmt)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "eyas"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_head(
    head: Eagle3Head,
    out_dir: str | Path,
    fmt: ExportFormat = "speculators",
    dtype: torch.dtype | None = torch.bfloat16,
    verifier: str | None = None,
) -> Path:
    """Export a head module. A head imported with its embedding (`load_any_head`
    sets `head.embedding_in_export`) ships it again, so import → export is lossless."""
    state = head_state_dict(head)
    if getattr(head, "embedding_in_export", False):
        state["embed_tokens.weight"] = head.embed_tokens.weight.detach()
    return write_export(head.config, state, out_dir, fmt, dtype, verifier)


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    fmt: ExportFormat = "speculators",
    dtype: torch.dtype | None = torch.bfloat16,
    verifier: str | None = None,
) -> Path:
    """Export an eyas checkpoint (head_config.json + head.safetensors) without needing the
    target: a frozen embedding is not part of the serving files."""
    ckpt = Path(checkpoint_dir)
    for name in (EYAS_CONFIG, EYAS_WEIGHTS):
        if not (ckpt / name).is_file():
            raise ExportFormatError(f"not an eyas checkpoint: {ckpt / name} is missing")
    cfg = DraftHeadConfig.load(ckpt / EYAS_CONFIG)
    state = load_file(str(ckpt / EYAS_WEIGHTS))
    return write_export(cfg, state, out_dir, fmt, dtype, verifier)


def serve_command(out_dir: str | Path, cfg: DraftHeadConfig) -> str:
    """The `vllm serve` line for this head (DESIGN §5)."""
    spec = speculative_config(cfg.algorithm, str(out_dir), cfg.speculative_tokens)
    return vllm_serve_command(cfg.verifier_name_or_path or "<target>", spec)


# --- import ---------------------------------------------------------------------------
