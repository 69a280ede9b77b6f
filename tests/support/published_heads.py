"""The published head layouts scaled down for CI (fixtures/published_heads: the published
config.json files, SOURCES.md says where each was read) and random tensors named and
shaped as each producer writes them; read by the import tests of every stage."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "published_heads"
H, HEADS, KV, HD, INTER, VT, VD = 64, 4, 2, 16, 128, 320, 100


def _scale(layer: dict) -> None:
    """Shrink a llama layer config's widths in place (layer count and options kept)."""
    layer.update(hidden_size=H, num_attention_heads=HEADS, intermediate_size=INTER, vocab_size=VT)
    for key, value in (("num_key_value_heads", KV), ("head_dim", HD)):
        if key in layer:
            layer[key] = value


def scaled_config(name: str) -> dict:
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    layer = raw.get("transformer_layer_config", raw)
    full_vocab = layer["vocab_size"]
    _scale(layer)
    if "draft_vocab_size" in raw:
        raw["draft_vocab_size"] = VT if raw["draft_vocab_size"] == full_vocab else VD
    if isinstance(raw.get("target_hidden_size"), int):
        raw["target_hidden_size"] = H
    for key in ("mask_token_id", "ptd_token_id"):
        if isinstance(raw.get(key), int):
            raw[key] = 7
    if not layer.get("head_dim"):
        layer["head_dim"] = H // HEADS  # shrinking the width must keep hidden // heads = head_dim
    return raw


def _aux_count(raw: dict) -> int:
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return len(ids) if ids else 3


def producer_tensors(raw: dict, producer: str) -> dict[str, torch.Tensor]:
    """Random tensors named as each producer saves them (speculators: `layers.0.*`;
    EAGLE / SpecForge / ModelOpt: `midlayer.*` for a one-layer head)."""
    layer = raw.get("transformer_layer_config", raw)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    n, layers = _aux_count(raw), layer["num_hidden_layers"]
    vd = raw.get("draft_vocab_size", VT)
    q, kv = HEADS * HD, layer.get("num_key_value_heads", HEADS) * HD
    out = {
        "fc.weight": rand(H, n * H),
        "norm.weight": torch.ones(H, dtype=dtype),
        "lm_head.weight": rand(vd, H),
    }
    for i in range(layers):
        p = "midlayer." if producer != "speculators" and layers == 1 else f"layers.{i}."
        width = 2 * H if i == 0 else H
        out.update(
            {
                p + "self_attn.q_proj.weight": rand(q, width),
                p + "self_attn.k_proj.weight": rand(kv, width),
                p + "self_attn.v_proj.weight": rand(kv, width),
                p + "self_attn.o_proj.weight": rand(H, q),
                p + "mlp.gate_proj.weight": rand(INTER, H),
                p + "mlp.up_proj.weight": rand(INTER, H),
                p + "mlp.down_proj.weight": rand(H, INTER),
                p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
                p + "hidden_norm.weight": torch.ones(H, dtype=dtype),
            }
        )
    if vd != VT:
        ids = torch.sort(torch.randperm(VT, generator=g)[:vd]).values
        out["d2t"] = ids - torch.arange(vd)
        if producer != "modelopt":  # ModelOpt ships d2t alone
            t2d = torch.zeros(VT, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
    if raw.get("fc_norm") or layer.get("fc_norm"):
        out.update({f"fc_norm.{i}.weight": torch.ones(H, dtype=dtype) for i in range(n)})
    if raw.get("norm_before_fc"):
        out["input_norm.weight"] = torch.ones(n * H, dtype=dtype)
    algo = raw.get("speculators_model_type")
    if algo == "peagle":
        out["mask_hidden"] = rand(1, n * H)
    if algo == "peagle" or producer == "specforge":  # SpecForge saves the (frozen) embedding too
        out["embed_tokens.weight"] = rand(VT, H)
    return out
