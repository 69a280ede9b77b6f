"""Save and load a trained head in eyas's own layout: `head_config.json` plus
`head.safetensors` (parameter names as in DESIGN §5). A frozen embedding is the target's
and is not stored: pass the target's embedding when loading."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.heads.algorithms import build_head
from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "head.safetensors"


def head_state_dict(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The tensors that define the head (the frozen target embedding left out)."""
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    if not head.trains_embedding:
        state.pop("embed_tokens.weight", None)
    return state


def save_head(head: Eagle3Head, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head.config.save(out / CONFIG_NAME)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(head_state_dict(head), str(tmp), metadata={"format": "pt", "producer": "eyas"})
    tmp.replace(out / WEIGHTS_NAME)
    return out


def load_head(head_dir: str | Path, target_embed: torch.Tensor | None = None, device="cpu") -> Eagle3Head:
    """Rebuild a head saved by `save_head`. `target_embed` [Vt, Ht] fills a frozen
    embedding; without it such a head cannot run and a clear error says so."""
    head_dir = Path(head_dir)
    cfg_path, w_path = head_dir / CONFIG_NAME, head_dir / WEIGHTS_NAME
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"not an eyas head directory: {p} is missing")
    config = DraftHeadConfig.load(cfg_path)
    head = build_head(config)
    state = load_file(str(w_path))
    if "embed_tokens.weight" not in state:
        if target_embed is None:
            raise ValueError(f"{head_dir}: the head shares the target's embedding; pass target_embed")
        state["embed_tokens.weight"] = target_embed.to(head.embed_tokens.weight.dtype)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{w_path}: missing tensors {missing}, unexpected tensors {unexpected}")
    return head.to(device)
