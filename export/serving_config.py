"""The serving config.json in one schema (DESIGN §5): the speculators layout (EAGLE-3 and
P-EAGLE), the original EAGLE-3 layout (a flat llama config) and the transformer layer
config both nest.

Export builds these models from a `DraftHeadConfig` (export/serving_build.py) and dumps
them: a model's field order is the order config.json is written in, and a field that is
left out when off or unset says so with `exclude_if` (tests/support/fixtures/exports pins the
bytes). Import validates a raw config.json with the same models; every validation error
becomes a problem naming its field path, and the fields that did validate are still read,
so a reader reports every problem (core/problems.py). What a value means against the
verifier or against other fields (aux ids vs layers, mask id vs vocabulary, ...) is
checked by the reader, `export/head_dir.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from eyas.core.problems import validate_listing_problems
from eyas.heads.algorithms import algorithm_names


def _registered(name: str) -> str:
    if name not in algorithm_names():
        raise ValueError(f"not a registered algorithm ({', '.join(algorithm_names())})")
    return name


AlgorithmName = Annotated[StrictStr, AfterValidator(_registered)]

SPECULATORS_VERSION = "0.3.0"
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
# HF LlamaConfig's defaults, which vLLM applies to a head config that leaves them out.
Number = StrictInt | StrictFloat  # an int stays an int, so a note quotes the value as written


def _is_none(value: Any) -> bool:
    return value is None


def _is_off(value: Any) -> bool:
    return not value


def _field(
    default: Any = ...,
    *,
    expected: str | None = None,
    omit: Any = None,
    description: str | None = None,
    **constraints: Any,
) -> Any:
    """A field with the words a problem uses for a wrong value (`expected`) and the rule
    that leaves it out of config.json (`omit`: `_is_none` or `_is_off`)."""
    extra = {"expected": expected} if expected else None
    return Field(default, exclude_if=omit, description=description, json_schema_extra=extra, **constraints)


def _optional(expected: str | None = None, **constraints: Any) -> Any:
    return _field(None, expected=expected, omit=_is_none, **constraints)


def _flag() -> Any:
    """An option written only when on (vLLM's default is off)."""
    return _field(False, expected="true or false", omit=_is_off)


class _Schema(BaseModel):
    # vLLM ignores keys it does not know and published heads carry many: they pass.
    model_config = ConfigDict(extra="ignore")


class RopeParameters(_Schema):
    """`rope_parameters` / `rope_scaling`; the scaling's own settings pass untouched."""

    model_config = ConfigDict(extra="allow")

    rope_type: StrictStr | None = _optional()
    type: StrictStr | None = _optional()  # older HF name of rope_type
    rope_theta: Number | None = _optional("a number")

    @property
    def kind(self) -> str | None:
        return self.rope_type or self.type


class TransformerLayerConfig(_Schema):
    """The head as a complete llama config; `vocab_size` is the target's vocabulary."""

    model_type: Literal["llama", "qwen3"] = _field(expected="'llama' or 'qwen3' (the heads vLLM serves)")
    architectures: list[StrictStr] | None = _optional("a non-empty list of strings", min_length=1)
    hidden_size: StrictInt
    num_attention_heads: StrictInt
    num_key_value_heads: StrictInt | None = _optional()
    head_dim: StrictInt | None = _optional()
    intermediate_size: StrictInt
    num_hidden_layers: StrictInt
    hidden_act: StrictStr | None = _optional()
    rms_norm_eps: Number | None = _optional("a number")
    rope_theta: Number | None = _optional("a number")
    rope_parameters: RopeParameters | None = _optional("an object")
    rope_scaling: RopeParameters | None = _optional("an object")
    max_position_embeddings: StrictInt | None = _optional()
    # Sliding-window head layers: vLLM's llama draft layer (0.32) reads the window only
    # through `layer_types` (one entry per head layer), as transformers' models do.
    sliding_window: StrictInt | None = _optional("a positive integer", ge=1)
    layer_types: list[StrictStr] | None = _optional("a list of strings")
    vocab_size: StrictInt
    attention_bias: StrictBool | None = _optional()
    mlp_bias: StrictBool | None = _optional()
    tie_word_embeddings: StrictBool | None = _optional()
    # vLLM's Eagle3 model takes the fc width from it (or from `eagle_config`), else assumes 3.
    num_aux_hidden_states: StrictInt | None = _optional()
    # P-EAGLE: vLLM's updater copies neither option from the top level, so they sit here too.
    fc_norm: StrictBool | None = _field(None, expected="true or false", omit=_is_off)
    norm_output: StrictBool | None = _field(None, expected="true or false", omit=_is_off)


class ProposalMethod(_Schema):
    proposal_type: StrictStr | None = _optional()
    speculative_tokens: StrictInt = _field(expected="K >= 1", ge=1)
    verifier_accept_k: StrictInt | None = _optional()
    accept_tolerance: Number | None = _optional("a number")


class Verifier(_Schema):
    name_or_path: StrictStr = _field(description="vllm serve DIR loads this target", min_length=1)
    architectures: list[StrictStr] = _field(expected="a non-empty list of strings", min_length=1)


class SpeculatorsBlock(_Schema):
    algorithm: StrictStr
    proposal_methods: list[ProposalMethod] = _field(expected="a non-empty list of objects", min_length=1)
    default_proposal_method: StrictStr
    verifier: Verifier = _field(expected="an object")


class EyasBlock(_Schema):
    """eyas's own facts (vLLM ignores them): what the validator checks aux ids against and
    what an import needs to rebuild the exact `DraftHeadConfig`."""

    target_num_layers: StrictInt | None = None
    target_model_type: StrictStr | None = None
    embedding_included: StrictBool | None = None


class EyasEagleBlock(EyasBlock):
    """The EAGLE layout has no speculators block: the head's algorithm, K and verifier live here."""

    algorithm: AlgorithmName | None = _field(None, expected="'eagle3' or 'peagle'")
    speculative_tokens: StrictInt | None = None
    verifier_name_or_path: StrictStr | None = None
    target_architectures: list[StrictStr] | None = None


class EagleBlock(_Schema):
    """`eagle_config` of the EAGLE layout (NVIDIA ModelOpt keeps the aux ids only here)."""

    eagle_aux_hidden_state_layer_ids: list[StrictInt] | None = _optional(
        "a non-empty list of integers", min_length=1
    )
    use_aux_hidden_state: StrictBool | None = _optional()
    norm_before_fc: StrictBool | None = _field(None, expected="true or false", omit=_is_off)


# The head's top-level fields, shared by both layouts (each model lists them in its key order).
# `draft_vocab_size` may be absent (it is then `vocab_size`) but not null.
_DRAFT_VOCAB = dict(expected="a positive integer", gt=0)
_TARGET_HIDDEN = dict(expected="an integer or null")  # null: the head's own width
_AUX_IDS = dict(expected="a non-empty list of integers", min_length=1)
_MASK_ID = dict(expected="an integer")


class SpeculatorsServingConfig(_Schema):
    """config.json of the speculators layout (no top-level `model_type`)."""

    architectures: list[StrictStr] = _field(expected="a non-empty list of strings", min_length=1)
    speculators_model_type: AlgorithmName = _field(expected="'eagle3' or 'peagle'")
    speculators_version: StrictStr = _field(expected="a non-empty string", min_length=1)
    transformer_layer_config: TransformerLayerConfig = _field(expected="an object")
    draft_vocab_size: StrictInt = _field(None, **_DRAFT_VOCAB)
    target_hidden_size: StrictInt | None = _field(None, **_TARGET_HIDDEN)
    # always written: vLLM's eagle3 and peagle readers default it differently
    norm_before_residual: StrictBool | None = _field(None, expected="true or false")
    norm_before_fc: StrictBool = _flag()
    fc_norm: StrictBool = _flag()
    norm_output: StrictBool = _flag()
    # at the top level: some vLLM runners read only this copy
    eagle_aux_hidden_state_layer_ids: list[StrictInt] | None = _optional(**_AUX_IDS)
    mask_token_id: StrictInt | None = _optional(**_MASK_ID)
    ptd_token_id: StrictInt | None = _optional(**_MASK_ID)  # vLLM 0.16 reads only this name
    speculators_config: SpeculatorsBlock = _field(expected="an object")
    eagle_config: EagleBlock | None = _optional("an object")  # read when given, never written
    eyas: EyasBlock | None = _optional("an object")

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


class EagleHeadFields(_Schema):
    """What the original EAGLE-3 layout adds to its flat llama config."""

    architectures: list[StrictStr] = _field(expected="a non-empty list of strings", min_length=1)
    draft_vocab_size: StrictInt = _field(None, **_DRAFT_VOCAB)
    target_hidden_size: StrictInt | None = _field(None, **_TARGET_HIDDEN)
    norm_before_residual: StrictBool | None = _field(None, expected="true or false")
    norm_before_fc: StrictBool = _flag()
    fc_norm: StrictBool = _flag()
    norm_output: StrictBool = _flag()
    eagle_aux_hidden_state_layer_ids: list[StrictInt] | None = _optional(**_AUX_IDS)
    eagle_config: EagleBlock | None = _optional("an object")
    mask_token_id: StrictInt | None = _optional(**_MASK_ID)
    ptd_token_id: StrictInt | None = _optional(**_MASK_ID)
    eyas: EyasEagleBlock | None = _optional("an object")


class EagleServingConfig(BaseModel):
    """config.json of the original EAGLE-3 layout: one flat dict that is both the head's
    llama config (`layer`) and its own fields (`head`); a key both carry keeps the layer's
    place in the file and the head's value."""

    layer: TransformerLayerConfig
    head: EagleHeadFields

    def to_dict(self) -> dict:
        return {**self.layer.model_dump(mode="json"), **self.head.model_dump(mode="json")}


ServingConfig = SpeculatorsServingConfig | EagleServingConfig


# --- import: a raw config.json ---------------------------------------------------------


@dataclass
class ParsedConfig:
    """A raw config.json read with the schema: the model (a refused value reads as None, a
    missing model as one whose fields are all None), a problem per error, and the paths
    whose given value was refused (so a reader does not take them as absent)."""

    config: ServingConfig
    problems: list[str] = field(default_factory=list)
    invalid: set[str] = field(default_factory=set)


def parse_serving_config(raw: dict, fmt: Literal["speculators", "eagle"]) -> ParsedConfig:
    """Validate a raw config.json of layout `fmt`; every problem is listed, none raised."""
    if fmt == "speculators":
        problems = []
        if "model_type" in raw:
            problems.append(
                "config.json has a top-level model_type; the speculators format must not "
                "(vLLM would not detect it as a speculators head)"
            )
        spec, found, invalid = validate_listing_problems(SpeculatorsServingConfig, raw)
        return ParsedConfig(spec, problems + found, invalid)
    layer, layer_problems, layer_invalid = validate_listing_problems(TransformerLayerConfig, raw)
    head, head_problems, head_invalid = validate_listing_problems(EagleHeadFields, raw)
    problems = layer_problems + [p for p in head_problems if p not in layer_problems]
    config = EagleServingConfig.model_construct(layer=layer, head=head)
    return ParsedConfig(config, problems, layer_invalid | head_invalid)
