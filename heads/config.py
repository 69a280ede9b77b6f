"""The draft head's configuration: its own shape plus what it must know of the target
(hidden size, vocabulary, which target layers feed it). Saved next to every checkpoint
as `head_config.json`; the exporter turns it into the serving config of DESIGN §5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DraftHeadConfig(BaseModel):
    """Shape and options of an EAGLE-3 or P-EAGLE head.

    `vocab_size` is the *target* vocabulary (Vt); `draft_vocab_size` (Vd) the rows of
    `lm_head`. `aux_layer_ids` index HF `hidden_states` of the target (id i = the residual
    stream entering decoder layer i), strictly ascending.
    """

    model_config = ConfigDict(extra="forbid")

    algorithm: str = "eagle3"  # a registered algorithm (heads/algorithms.py)
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The target's (or an imported head's) RoPE scaling, transformers' layout without the
    # base: `{"rope_type": "llama3", "factor": 8.0, ...}`; None is plain RoPE (heads/rope.py).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    # Every head layer attends to the last `sliding_window` positions only (a query at
    # position i to keys at i - W + 1 .. i, as vLLM's and transformers' windows); None: the
    # whole context. Exported as vLLM's `layer_types` + `sliding_window` (DESIGN §3, §5).
    sliding_window: int | None = Field(None, ge=1)
    hidden_act: Literal["silu"] = "silu"
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_num_layers: int
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    mask_token_id: int | None = None
    speculative_tokens: int = 5
    target_model_type: str = "llama"
    target_architectures: list[str] = ["LlamaForCausalLM"]
    verifier_name_or_path: str | None = None

    @field_validator("algorithm")
    @classmethod
    def _registered(cls, name: str) -> str:
        from eyas.heads.algorithms import get_algorithm

        get_algorithm(name)  # an unknown name is refused, naming the known ones
        return name

    @field_validator("rope_scaling")
    @classmethod
    def _applicable_rope(cls, scaling: dict | None) -> dict | None:
        from eyas.heads.rope import scaling_from_parameters

        return scaling_from_parameters(scaling)

    @model_validator(mode="after")
    def _check(self) -> DraftHeadConfig:
        ids = self.aux_layer_ids
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"aux_layer_ids must be non-empty and strictly ascending, got {ids}")
        # id i is the input of decoder layer i; id L (after the last layer) is pre-norm in
        # vLLM but post-norm in HF, so it is refused rather than silently trained wrong.
        if ids[0] < 0 or ids[-1] >= self.target_num_layers:
            raise ValueError(
                f"aux_layer_ids {ids} must lie in 0..{self.target_num_layers - 1} (the target's layer inputs)"
            )
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc exclude each other")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}"
            )
        if self.algorithm_spec.needs_mask_token:
            if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
                raise ValueError(
                    f"a P-EAGLE head needs a mask_token_id inside the vocabulary, got {self.mask_token_id}"
                )
        from eyas.heads.rope import rope_frequencies

        # a setting transformers cannot apply fails here, at load, not at the first step
        rope_frequencies(self.head_dim, self.rope_theta, self.max_position_embeddings, self.rope_scaling)
        return self

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux * self.target_hidden_size

    @property
    def uses_vocab_map(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def trains_embedding(self) -> bool:
        """P-EAGLE learns the mask-token row (`mask_embedding`), so its table is its own:
        stored in checkpoints and exported with that row written in."""
        return self.algorithm_spec.trains_embedding

    @property
    def algorithm_spec(self):
        """The registered `Algorithm` of this head."""
        from eyas.heads.algorithms import get_algorithm

        return get_algorithm(self.algorithm)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DraftHeadConfig:
        return cls.model_validate_json(Path(path).read_text())


def _rope_parameters(text_cfg) -> dict:
    """The target's rope parameters (transformers 5 merges `rope_scaling` into them); for
    per-layer-type parameters, the full-attention layers' ones."""
    params = getattr(text_cfg, "rope_parameters", None) or getattr(text_cfg, "rope_scaling", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return params if isinstance(params, dict) else {}


def _rope_theta(text_cfg) -> float:
    params = _rope_parameters(text_cfg)
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(text_cfg, "rope_theta", 10000.0) or 10000.0)


def target_rope_scaling(text_cfg) -> dict | None:
    """The target's RoPE scaling as the head carries it (None: plain RoPE); a scaling the
    head cannot apply is refused, naming the target's key."""
    from eyas.heads.rope import scaling_from_parameters

    return scaling_from_parameters(_rope_parameters(text_cfg) or None, "the target's config rope_parameters")


def head_config_from_target(
    text_cfg,
    *,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    algorithm: str = "eagle3",
    num_hidden_layers: int = 1,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    architectures: list[str] | None = None,
    verifier_name_or_path: str | None = None,
    **options,
) -> DraftHeadConfig:
    """A head shaped like one decoder layer of the target (the usual choice), with any
    field overridden. `text_cfg` is the target's HF (text) config."""
    ht = text_cfg.hidden_size
    h = hidden_size or ht
    n_heads = num_attention_heads or text_cfg.num_attention_heads
    hd = head_dim or getattr(text_cfg, "head_dim", None) or h // n_heads
    n_kv = num_key_value_heads or getattr(text_cfg, "num_key_value_heads", None) or n_heads
    inter = intermediate_size or getattr(text_cfg, "intermediate_size", None) or 4 * h
    vocab = text_cfg.vocab_size
    return DraftHeadConfig(
        algorithm=algorithm,
        hidden_size=h,
        target_hidden_size=ht,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=hd,
        intermediate_size=inter,
        num_hidden_layers=num_hidden_layers,
        rms_norm_eps=float(getattr(text_cfg, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(text_cfg),
        max_position_embeddings=int(getattr(text_cfg, "max_position_embeddings", 4096)),
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size, vocab),
        aux_layer_ids=list(aux_layer_ids),
        target_num_layers=text_cfg.num_hidden_layers,
        target_model_type=text_cfg.model_type,
        target_architectures=list(
            architectures or getattr(text_cfg, "architectures", None) or ["LlamaForCausalLM"]
        ),
        verifier_name_or_path=verifier_name_or_path,
        **{"rope_scaling": target_rope_scaling(text_cfg), **options},
    )
