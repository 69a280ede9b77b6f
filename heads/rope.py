"""The head's rotary position embedding (DESIGN §3): plain RoPE, or the scaling the target
(or an imported head) declares in `rope_scaling`. The scaled frequencies come from
transformers' own rope functions (`modeling_rope_utils`), the ones the target runs with
and vLLM's draft layer matches, so the head rotates as it will be served.

Only the scalings whose frequencies do not depend on the sequence length are accepted:
`linear`, `llama3` and `yarn`. `dynamic` and `longrope` change the frequencies with the
length a call sees, which a KV-cached draft layer and a training batch see differently,
so they are refused, naming the key, instead of being trained as something else.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import torch

SCALED_ROPE_TYPES = ("linear", "llama3", "yarn")
# Keys of a target's rope parameters that are not the scaling itself: the base is the
# head's `rope_theta`, and the head's llama layer rotates every dimension.
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


class RopeScalingError(ValueError):
    """A `rope_scaling` the head cannot apply; the message names the key."""


def scaling_from_parameters(params: Any, where: str = "rope_scaling") -> dict | None:
    """A rope parameters / rope_scaling dict (transformers' layout, `type` the older name of
    `rope_type`) -> the head's `rope_scaling` (`rope_type` first, then its settings), or
    None for plain RoPE. Refuses a type the head cannot apply, naming `where`."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise RopeScalingError(f"{where} must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type parameters (sliding and full layers rotating differently): the
        # head's one layer attends over the whole context, as a full layer does
        if "full_attention" not in params:
            raise RopeScalingError(
                f"{where} holds parameters per layer type {sorted(params)} and none for 'full_attention'"
            )
        return scaling_from_parameters(params["full_attention"], f"{where}.full_attention")
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return None
    if kind not in SCALED_ROPE_TYPES:
        raise RopeScalingError(
            f"{where}.rope_type {kind!r} is not supported by eyas's head (supported: "
            f"{', '.join(SCALED_ROPE_TYPES)}); a head trained with another rotation would draft "
            "differently from the one vLLM serves"
        )
    settings = {k: v for k, v in params.items() if k not in ("rope_type", "type", *_NOT_SCALING)}
    return {"rope_type": kind, **settings}


def _hf_config(head_dim: int, theta: float, max_positions: int, scaling: dict | None):
    from transformers import LlamaConfig

    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    return LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=params,
    )


@functools.lru_cache(maxsize=64)
def _frequencies(
    head_dim: int, theta: float, max_positions: int, scaling_json: str, where: str
) -> tuple[torch.Tensor, float]:
    scaling = json.loads(scaling_json)
    if scaling is None:
        # plain RoPE as Llama computes it (the same numbers as before scaling existed)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = scaling["rope_type"]
    try:
        cfg = _hf_config(head_dim, theta, max_positions, scaling)
        inv, attention_factor = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    except (KeyError, TypeError, ValueError) as err:
        raise RopeScalingError(f"{where} {scaling}: transformers cannot apply it ({err})") from None
    inv = inv.float()
    if inv.shape != (head_dim // 2,) or not torch.isfinite(inv).all() or not math.isfinite(attention_factor):
        raise RopeScalingError(f"{where} {scaling}: gives no finite frequencies for head_dim {head_dim}")
    return inv, float(attention_factor)


def rope_frequencies(
    head_dim: int, theta: float, max_positions: int, scaling: dict | None, where: str = "rope_scaling"
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies `[head_dim/2]` (float32, CPU) and the factor cos and sin are
    multiplied by (yarn's attention factor; 1 otherwise). Raises `RopeScalingError`, naming
    `where`, for a scaling transformers cannot compute (a missing or bad setting)."""
    return _frequencies(
        head_dim, float(theta), int(max_positions), json.dumps(scaling, sort_keys=True), where
    )


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (rotate-half layout, as Llama)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin
