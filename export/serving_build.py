"""The serving config.json built from a `DraftHeadConfig` (DESIGN §5): the speculators
layout and the original EAGLE-3 layout, as models of the schema in
export/serving_config.py, whose field order is the order config.json is written in.
"""

from __future__ import annotations

from typing import Any

from eyas.export.serving_config import (
    EAGLE_ARCHITECTURE,
    SPECULATORS_VERSION,
    EagleBlock,
    EagleHeadFields,
    EagleServingConfig,
    EyasBlock,
    EyasEagleBlock,
    ProposalMethod,
    RopeParameters,
    SpeculatorsBlock,
    SpeculatorsServingConfig,
    TransformerLayerConfig,
    Verifier,
)
from eyas.heads.algorithms import get_algorithm
from eyas.heads.config import DraftHeadConfig


def build_layer(cfg: DraftHeadConfig) -> TransformerLayerConfig:
    # vLLM's P-EAGLE (parallel drafting) reader copies neither option from the top level.
    peagle = cfg.algorithm_spec.parallel_drafting
    return TransformerLayerConfig(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        **_rope_fields(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention"] * cfg.num_hidden_layers if cfg.sliding_window else None,
        vocab_size=cfg.vocab_size,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        num_aux_hidden_states=cfg.num_aux,
        fc_norm=peagle and cfg.fc_norm,
        norm_output=peagle and cfg.norm_output,
    )


def _rope_fields(cfg: DraftHeadConfig) -> dict[str, Any]:
    """`rope_parameters` (transformers 5, vLLM 0.32) and, for a scaled head, the same
    scaling as `rope_scaling` too (older readers take only that key): both say the same,
    so whichever a reader prefers it rotates as the head was trained."""
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    kind, settings = scaling["rope_type"], {k: v for k, v in scaling.items() if k != "rope_type"}
    out = {"rope_parameters": RopeParameters(rope_type=kind, rope_theta=cfg.rope_theta, **settings)}
    if cfg.rope_scaling:
        out["rope_scaling"] = RopeParameters(rope_type=kind, **settings)
    return out


def _head_fields(cfg: DraftHeadConfig) -> dict[str, Any]:
    """The top-level head fields both layouts write."""
    mask = cfg.mask_token_id if cfg.algorithm_spec.needs_mask_token else None
    return dict(
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size,
        norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
        mask_token_id=mask,
        ptd_token_id=mask,
    )


def _eyas_fields(cfg: DraftHeadConfig, ships_embedding: bool) -> dict[str, Any]:
    return dict(
        target_num_layers=cfg.target_num_layers,
        target_model_type=cfg.target_model_type,
        embedding_included=ships_embedding,
    )


def build_speculators(
    cfg: DraftHeadConfig, verifier: str | None = None, ships_embedding: bool = False
) -> SpeculatorsServingConfig:
    verifier = verifier or cfg.verifier_name_or_path
    if not verifier:
        raise ValueError("the serving config needs the verifier's Hub id or path: pass --verifier")
    method = ProposalMethod(
        proposal_type="greedy",
        speculative_tokens=cfg.speculative_tokens,
        verifier_accept_k=1,
        accept_tolerance=0.0,
    )
    return SpeculatorsServingConfig(
        architectures=[get_algorithm(cfg.algorithm).speculators_architecture],
        speculators_model_type=cfg.algorithm,
        speculators_version=SPECULATORS_VERSION,
        transformer_layer_config=build_layer(cfg),
        **_head_fields(cfg),
        speculators_config=SpeculatorsBlock(
            algorithm=cfg.algorithm,
            proposal_methods=[method],
            default_proposal_method="greedy",
            verifier=Verifier(name_or_path=verifier, architectures=list(cfg.target_architectures)),
        ),
        eyas=EyasBlock(**_eyas_fields(cfg, ships_embedding)),
    )


def build_eagle(
    cfg: DraftHeadConfig, verifier: str | None = None, ships_embedding: bool = False
) -> EagleServingConfig:
    head = EagleHeadFields(
        architectures=[EAGLE_ARCHITECTURE],
        **_head_fields(cfg),
        eagle_config=EagleBlock(
            eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
            use_aux_hidden_state=True,
            norm_before_fc=cfg.norm_before_fc,
        ),
        eyas=EyasEagleBlock(
            **_eyas_fields(cfg, ships_embedding),
            algorithm=cfg.algorithm,
            speculative_tokens=cfg.speculative_tokens,
            verifier_name_or_path=verifier or cfg.verifier_name_or_path,
            target_architectures=list(cfg.target_architectures),
        ),
    )
    return EagleServingConfig(layer=build_layer(cfg), head=head)
