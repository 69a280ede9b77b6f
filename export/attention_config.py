"""What the head's attention reads from a serving config's layer (DESIGN §5.1): its RoPE
scaling (heads/rope.py) and its sliding window, each refused as a problem naming the key
when eyas's head cannot apply it, as every reader of a head directory does."""

from __future__ import annotations

from eyas.export.layer_shape import LayerShape
from eyas.export.serving_config import TransformerLayerConfig
from eyas.heads.rope import RopeScalingError, rope_frequencies, scaling_from_parameters


def read_attention(
    layer: TransformerLayerConfig, shape: LayerShape, where: str, notes: list[str], problems: list[str]
) -> dict:
    """`{"rope_scaling", "sliding_window"}` of the layer; notes and problems appended."""
    scaling, problem = layer_rope_scaling(layer, shape, where)
    window, note, window_problem = layer_window(layer, where)
    notes.extend(n for n in (note,) if n)
    problems.extend(p for p in (problem, window_problem) if p)
    return {"rope_scaling": scaling, "sliding_window": window}


def layer_rope_scaling(
    layer: TransformerLayerConfig, shape: LayerShape, where: str
) -> tuple[dict | None, str | None]:
    """The layer's RoPE scaling as the head carries it, read as transformers reads it (a
    non-null `rope_scaling` wins over `rope_parameters`), or a problem naming the key
    when eyas's head cannot apply it (heads/rope.py)."""
    key, params = next(
        (
            (k, p)
            for k, p in (("rope_scaling", layer.rope_scaling), ("rope_parameters", layer.rope_parameters))
            if p
        ),
        (None, None),
    )
    if params is None:
        return None, None
    try:
        scaling = scaling_from_parameters(params.model_dump(mode="json"), f"{where}{key}")
        if scaling and shape.head_dim:
            rope_frequencies(
                shape.head_dim, shape.rope_theta, shape.max_position_embeddings, scaling, f"{where}{key}"
            )
        return scaling, None
    except RopeScalingError as err:
        return None, str(err)


def layer_window(layer: TransformerLayerConfig, where: str) -> tuple[int | None, str | None, str | None]:
    """The head's sliding window as vLLM applies it: `layer_types` all
    "sliding_attention" with a `sliding_window` (eyas's head has one window for every
    layer), or none. Returns (window, note, problem)."""
    types, window = layer.layer_types, layer.sliding_window
    if not types:
        if window is None:
            return None, None, None
        return (
            None,
            (
                f"{where}sliding_window {window} without layer_types: vLLM's llama draft layer reads a "
                "window only through layer_types, so the head attends to the whole context (read so)"
            ),
            None,
        )
    if layer.num_hidden_layers is not None and len(types) != layer.num_hidden_layers:
        return None, None, f"{where}layer_types has {len(types)} entries for {layer.num_hidden_layers} layers"
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None, None, None
    if kinds == {"sliding_attention"} and window is not None:
        return window, None, None
    if kinds == {"sliding_attention"}:
        return None, None, f"{where}layer_types are sliding_attention but sliding_window is missing"
    return (
        None,
        None,
        (
            f"{where}layer_types {types}: eyas's head applies one sliding window to every layer or none "
            "(full_attention / sliding_attention)"
        ),
    )
