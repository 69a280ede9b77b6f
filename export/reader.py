"""Read head directories back: the speculators and original EAGLE-3 layouts that
`export/writer.py` writes (and published heads in them), and eyas checkpoints, into an
`Eagle3Head` / `PEagleHead`. Export after import reproduces the tensors bit for bit.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eyas.export.head_dir import TargetFacts, detect_format, read_head_dir
from eyas.export.head_weights import canonical_tensors
from eyas.export.validate import ExportValidationError, inspect_export
from eyas.export.writer import ExportFormatError
from eyas.heads.algorithms import build_head
from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.io import load_head

log = logging.getLogger(__name__)


def config_from_fields(f: dict) -> DraftHeadConfig:
    """A `DraftHeadConfig` from the fields `read_head_dir` normalised (no problems left)."""
    return DraftHeadConfig(
        algorithm=f["algo"],
        hidden_size=f["h"],
        target_hidden_size=f["ht"],
        num_attention_heads=f["heads"],
        num_key_value_heads=f["kv"],
        head_dim=f["hd"],
        intermediate_size=f["inter"],
        num_hidden_layers=f["layers"],
        rms_norm_eps=f["rms_norm_eps"],
        rope_theta=f["rope_theta"],
        rope_scaling=f["rope_scaling"],
        sliding_window=f["sliding_window"],
        max_position_embeddings=f["max_position_embeddings"],
        vocab_size=f["vt"],
        draft_vocab_size=f["vd"],
        aux_layer_ids=list(f["aux"]),
        target_num_layers=f["target_num_layers"],
        norm_before_residual=f["norm_before_residual"],
        norm_before_fc=f["before_fc"],
        fc_norm=f["fc_norm"],
        norm_output=f["norm_output"],
        mask_token_id=f["mask_id"],
        speculative_tokens=f["k"] or 5,
        target_model_type=f["target_model_type"],
        target_architectures=list(f["target_architectures"] or ["LlamaForCausalLM"]),
        verifier_name_or_path=f["verifier"],
    )


def export_config(head_dir: str | Path, target: TargetFacts | None = None) -> DraftHeadConfig:
    """The head config of an export directory, from its config.json alone (no tensors)."""
    hd = read_head_dir(head_dir, target)
    if hd.problems:
        raise ExportValidationError(head_dir, hd.problems)
    return config_from_fields(hd.fields)


def _head_state(tensors: dict[str, torch.Tensor], cfg: DraftHeadConfig) -> dict[str, torch.Tensor]:
    state = {}
    for name, t in canonical_tensors(tensors).items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[1] != "0" and parts[2] == "hidden_norm":
            continue  # built but unused by vLLM in layers >= 1; our layers have none
        state[name] = t
    if cfg.uses_vocab_map and "t2d" not in state:  # vLLM needs only d2t; t2d follows from it
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"].long()] = True
        state["t2d"] = t2d
    return state


def load_any_head(
    head_dir: str | Path,
    target_embed: torch.Tensor | None = None,
    device="cpu",
    dtype: torch.dtype | None = None,
    target: TargetFacts | None = None,
) -> Eagle3Head:
    """An `Eagle3Head` / `PEagleHead` from an eyas checkpoint, a speculators export or an
    EAGLE-format export. An export is read as `eyas export --check` reads it (a head it
    reports problems with is refused, with the same list); `target` holds the verifier's
    facts when the caller has its config.

    The head's floats take the stored dtype (or `dtype`). Without `embed_tokens.weight`
    in the file, `target_embed` [Vt, Ht] fills the frozen embedding."""
    if detect_format(head_dir) == "eyas":
        head = load_head(head_dir, target_embed, device)
        return head.to(dtype) if dtype is not None else head
    hd, tensors = inspect_export(head_dir, target)
    if hd.problems:
        raise ExportValidationError(head_dir, hd.problems)
    for note in hd.notes:
        log.warning("%s: %s", head_dir, note)
    cfg = config_from_fields(hd.fields)
    state = _head_state(tensors, cfg)
    head = build_head(cfg)
    float_dtype = dtype or (state["fc.weight"].dtype if "fc.weight" in state else torch.float32)
    head.to(float_dtype)
    has_embed = "embed_tokens.weight" in state
    if not has_embed:
        if head.trains_embedding:
            raise ExportFormatError(
                f"{head_dir}: this head needs its own embed_tokens.weight and the file has none"
            )
        if target_embed is None:
            raise ValueError(
                f"{head_dir}: the head shares the target's embedding; pass target_embed [Vt, Ht]"
            )
        state["embed_tokens.weight"] = target_embed.to(float_dtype)
    if not cfg.uses_vocab_map:
        state.pop("d2t", None)
        state.pop("t2d", None)
    state = {k: (v.to(float_dtype) if v.is_floating_point() else v) for k, v in state.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportFormatError(
            f"{head_dir}: missing tensors {sorted(missing)}, unexpected tensors {sorted(unexpected)}"
        )
    head.embedding_in_export = has_embed
    return head.to(device)
