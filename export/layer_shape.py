"""A serving config's transformer layer with the llama defaults vLLM applies where a key
is absent (DESIGN §5.1), each default taken noted, so every reader of a head directory
sizes the layer as the engine will."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.core.problems import given
from eyas.export.serving_config import TransformerLayerConfig

LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0}


@dataclass(frozen=True)
class LayerShape:
    """The layer's values with vLLM's defaults applied (None where unknown)."""

    num_key_value_heads: int | None
    head_dim: int | None
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


def layer_shape(
    layer: TransformerLayerConfig, where: str, invalid: set[str] | frozenset = frozenset()
) -> tuple[LayerShape, list[str]]:
    """The layer with the llama defaults vLLM applies, and a note for each default taken;
    a value the schema refused (`invalid`, paths as `ParsedConfig` has them) stays unknown."""
    notes, defaulted = [], []
    h, heads = layer.hidden_size, layer.num_attention_heads
    kv, hd = layer.num_key_value_heads, layer.head_dim
    refused = {key for key in ("num_key_value_heads", "head_dim") if f"{where}{key}" in invalid}
    if kv is None and heads is not None and "num_key_value_heads" not in refused:
        kv = heads
        defaulted.append(f"num_key_value_heads={heads}")
    if hd is None and h is not None and heads and "head_dim" not in refused:
        hd = h // heads
        defaulted.append(f"head_dim={hd}")
    params = layer.rope_parameters
    written = {
        "rms_norm_eps": layer.rms_norm_eps,
        "max_position_embeddings": layer.max_position_embeddings,
        # a rope_theta key in rope_parameters wins, even null (as HF reads it)
        "rope_theta": params.rope_theta if given(params, "rope_theta") else layer.rope_theta,
    }
    values = {}
    for key, default in LLAMA_DEFAULTS.items():
        values[key] = written[key]
        if values[key] is None:
            values[key] = default
            defaulted.append(f"{key}={default}")
    if defaulted:
        notes.append(
            f"{where or 'config.json: '}absent, the llama defaults vLLM applies: {', '.join(defaulted)}"
        )
    shape = LayerShape(
        kv, hd, values["rms_norm_eps"], float(values["rope_theta"]), values["max_position_embeddings"]
    )
    return shape, notes
