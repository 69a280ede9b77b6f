"""Assemble what a run trains: the head shaped from the recipe and the target, its draft
vocabulary from token frequencies, its initial weights from the target, and the frozen
target output layers (final norm + LM head) the labels are computed with."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from eyas.heads.algorithms import build_head, get_algorithm
from eyas.heads.config import DraftHeadConfig, head_config_from_target
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.peagle import choose_mask_token_id
from eyas.heads.vocab import build_vocab_map, draft_vocab_coverage, fit_frequencies
from eyas.target.features import default_aux_layer_ids, target_norm_and_lm_head
from eyas.target.load import text_config

log = logging.getLogger(__name__)


@dataclass
class FrozenOutput:
    """The target's final norm and LM head weight `[Vt, Ht]`: labels = lm_head(norm(last))."""

    norm: nn.Module
    lm_head_weight: torch.Tensor


def frozen_output(target_model: nn.Module) -> FrozenOutput:
    norm, lm_head = target_norm_and_lm_head(target_model)
    return FrozenOutput(norm=norm, lm_head_weight=lm_head.weight.detach())


def aux_layer_ids_for(recipe, target_config) -> list[int]:
    """The recipe's aux layer ids, else EAGLE-3's default (2, L//2, L-3)."""
    ids = recipe.data.aux_layer_ids
    return list(ids) if ids else list(default_aux_layer_ids(text_config(target_config).num_hidden_layers))


def head_config_for(
    recipe,
    target_config,
    verifier: str | None = None,
    tokenizer=None,
    token_freqs: torch.Tensor | None = None,
) -> DraftHeadConfig:
    """The head config of a recipe's `head` section over the target's HF config. A P-EAGLE
    head without an explicit mask id gets one from `choose_mask_token_id` (the tokenizer's
    mask token, else an unused or reserved id; never pad/EOS, whose rows the target uses)."""
    h = recipe.head
    mask_id = h.mask_token_id
    if h.draft_vocab_size > (vocab := text_config(target_config).vocab_size):
        log.warning(
            "head.draft_vocab_size %d is above the target's vocabulary (%d): the head drafts over the "
            "whole target vocabulary, with no draft-vocabulary map",
            h.draft_vocab_size,
            vocab,
        )
    if get_algorithm(h.algorithm).needs_mask_token:
        mask_id = choose_mask_token_id(
            tokenizer, text_config(target_config).vocab_size, explicit=mask_id, token_freqs=token_freqs
        )
    return head_config_from_target(
        text_config(target_config),
        aux_layer_ids=aux_layer_ids_for(recipe, target_config),
        draft_vocab_size=h.draft_vocab_size,
        algorithm=h.algorithm,
        num_hidden_layers=h.num_layers,
        hidden_size=h.hidden_size,
        intermediate_size=h.intermediate_size,
        num_attention_heads=h.num_attention_heads,
        num_key_value_heads=h.num_key_value_heads,
        head_dim=h.head_dim,
        architectures=getattr(target_config, "architectures", None),
        verifier_name_or_path=verifier,
        norm_before_residual=h.norm_before_residual,
        norm_before_fc=h.norm_before_fc,
        fc_norm=h.fc_norm,
        norm_output=h.norm_output,
        mask_token_id=mask_id,
        speculative_tokens=h.speculative_tokens,
        sliding_window=h.sliding_window,
    )


def build_trainable_head(
    config: DraftHeadConfig, target_model: nn.Module, freqs: torch.Tensor | None
) -> Eagle3Head:
    """A float32 head with its vocabulary map set (from `freqs` [Vt], the masked-token
    counts) and its embedding / LM head rows / final norm copied from the target."""
    norm, lm_head = target_norm_and_lm_head(target_model)
    embed = target_model.get_input_embeddings().weight
    return head_from_target_weights(
        config, freqs, embed.detach(), lm_head.weight.detach(), norm.weight.detach()
    )


def head_from_target_weights(
    config: DraftHeadConfig,
    freqs: torch.Tensor | None,
    embed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    norm_weight: torch.Tensor,
) -> Eagle3Head:
    """`build_trainable_head` from the target's tensors alone: embed / lm_head_weight
    [Vt, Ht], norm_weight [Ht] (benchmarks build heads at a target's shape without it)."""
    head = build_head(config).float()
    if config.uses_vocab_map:
        if freqs is None:
            raise ValueError(
                "a draft vocabulary smaller than the target's needs token frequencies "
                "(run `eyas prepare`: prepared/token_freqs.safetensors)"
            )
        vmap = build_vocab_map(fit_frequencies(freqs, config.vocab_size), config.draft_vocab_size)
        head.set_vocab_map(vmap.d2t, vmap.t2d)
    head.init_from_target(embed.float().cpu(), lm_head_weight.float().cpu(), norm_weight.float().cpu())
    return head


class HeadWithLoss(nn.Module):
    """The module handed to accelerate (DDP / DeepSpeed / FSDP wrap only this): its forward
    runs the algorithm's loss on the head, so every parameter access happens inside the
    wrapper's forward (gradient sync hooks, ZeRO-3 / FSDP gathering)."""

    def __init__(self, head: Eagle3Head, loss_fn, train_cfg):
        super().__init__()
        self.head = head
        self.loss_fn = loss_fn
        self.train_cfg = train_cfg

    def forward(self, batch: dict, labels, generator=None):
        return self.loss_fn(self.head, batch, labels, self.train_cfg, generator)


# --- starting from an existing head (train.init_from, DESIGN §5.2) --------------------

# recipe head field -> the head config field it sets
HEAD_SHAPE_FIELDS = {
    "num_layers": "num_hidden_layers",
    "draft_vocab_size": "draft_vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_before_residual": "norm_before_residual",
    "norm_before_fc": "norm_before_fc",
    "fc_norm": "fc_norm",
    "norm_output": "norm_output",
}


class InitFromError(ValueError):
    """A `train.init_from` head the recipe contradicts or the target cannot feed."""


def init_from_config(
    recipe,
    imported: DraftHeadConfig,
    target_config,
    source: str,
    verifier: str | None = None,
    tokenizer=None,
    token_freqs: torch.Tensor | None = None,
) -> DraftHeadConfig:
    """The config of a run that starts from `imported`: its architecture, the recipe's
    algorithm and K. A recipe head field set explicitly to another value is an error that
    names both; so are aux layers the data is captured at but the head does not read."""
    h = recipe.head
    # More layers than the source's is a growth (`head_from_checkpoint` appends layers that
    # start as the identity); fewer would discard trained layers.
    grows = "num_layers" in h.model_fields_set and h.num_layers > imported.num_hidden_layers
    conflicts = [
        f"head.{key} = {getattr(h, key)!r}, but {source} has {field} = {getattr(imported, field)!r}"
        for key, field in HEAD_SHAPE_FIELDS.items()
        if key in h.model_fields_set
        and getattr(h, key) != getattr(imported, field)
        and not (key == "num_layers" and grows)
    ]
    ids = recipe.data.aux_layer_ids
    if ids and list(ids) != list(imported.aux_layer_ids):
        conflicts.append(
            f"data.aux_layer_ids = {list(ids)}, but {source} reads target layers {imported.aux_layer_ids}"
        )
    text = text_config(target_config)
    for what, mine, theirs in (
        ("hidden size", imported.target_hidden_size, text.hidden_size),
        ("vocabulary", imported.vocab_size, text.vocab_size),
    ):
        if mine != theirs:
            conflicts.append(f"{source} was built for a target {what} of {mine}; this target's is {theirs}")
    if imported.aux_layer_ids[-1] >= text.num_hidden_layers:
        conflicts.append(
            f"{source} reads target layers {imported.aux_layer_ids}; this target has {text.num_hidden_layers}"
        )
    if conflicts:
        raise InitFromError(
            "train.init_from: " + "; ".join(conflicts) + ". Drop those keys from the recipe "
            "(the head's own values are used) or train a fresh head"
        )
    mask_id = imported.mask_token_id
    needs_mask, had_mask = (get_algorithm(a).needs_mask_token for a in (h.algorithm, imported.algorithm))
    if needs_mask and (not had_mask or h.mask_token_id is not None):
        if had_mask and h.mask_token_id != imported.mask_token_id:
            raise InitFromError(
                f"train.init_from: head.mask_token_id = {h.mask_token_id}, but {source} trained "
                f"mask token {imported.mask_token_id}"
            )
        mask_id = choose_mask_token_id(
            tokenizer, text.vocab_size, explicit=h.mask_token_id, token_freqs=token_freqs
        )
    if not needs_mask:
        mask_id = None
    return imported.model_copy(
        update=dict(
            algorithm=h.algorithm,
            num_hidden_layers=h.num_layers if grows else imported.num_hidden_layers,
            mask_token_id=mask_id,
            speculative_tokens=h.speculative_tokens,
            # a window changes which keys the layers read, not their shape: a head continued
            # for long contexts may take one (or another)
            sliding_window=h.sliding_window
            if "sliding_window" in h.model_fields_set
            else imported.sliding_window,
            target_num_layers=text.num_hidden_layers,
            target_model_type=text.model_type,
            target_architectures=list(
                getattr(target_config, "architectures", None) or imported.target_architectures
            ),
            verifier_name_or_path=verifier or imported.verifier_name_or_path,
        )
    )


@torch.no_grad()
def head_from_checkpoint(
    config: DraftHeadConfig, source: Eagle3Head, target_model: nn.Module
) -> tuple[Eagle3Head, list[str]]:
    """A float32 head of `config` holding `source`'s weights and draft vocabulary. What
    `source` lacks (a P-EAGLE head's mask parameters, started from an EAGLE-3 head) is
    initialised as for a fresh head, except layers appended past the source's: their
    attention and MLP output projections start at zero, so each adds nothing to the
    residual stream and the grown head drafts exactly as the source did until training
    moves them. Returns the head and the names started fresh."""
    norm, lm_head = target_norm_and_lm_head(target_model)
    embed = target_model.get_input_embeddings().weight
    head = build_head(config).float()
    head.init_from_target(
        embed.detach().float().cpu(),
        lm_head.weight.detach().float().cpu(),
        norm.weight.detach().float().cpu(),
    )
    theirs = source.state_dict()
    # A head that does not train its embedding serves with the target's, so only a head
    # that trains one takes the source's own.
    own_embedding = head.trains_embedding and (
        source.trains_embedding or getattr(source, "embedding_in_export", False)
    )
    fresh = []
    for name, t in head.state_dict().items():
        if name == "embed_tokens.weight" and not own_embedding:
            continue  # the target's, already copied
        if name in theirs and theirs[name].shape == t.shape:
            t.copy_(theirs[name].to(t.dtype))
        else:
            fresh.append(name)
    appended = [f"layers.{i}" for i in range(source.config.num_hidden_layers, config.num_hidden_layers)]
    fresh = [n for n in fresh if not n.startswith(tuple(a + "." for a in appended))] + appended
    if (
        get_algorithm(config.algorithm).needs_mask_token
        and not get_algorithm(source.config.algorithm).needs_mask_token
        and own_embedding
    ):
        head.mask_embedding.copy_(head.embed_tokens.weight.mean(0))
    for layer in head.layers[source.config.num_hidden_layers :]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return head, fresh


def initial_head(
    recipe, target, freqs: torch.Tensor | None, verifier: str | None
) -> tuple[Eagle3Head, DraftHeadConfig]:
    """The head a run starts from: `train.init_from`'s weights when it names one, else a
    fresh head shaped by the recipe (both float32, on the CPU)."""
    source_name = recipe.train.init_from
    if not source_name:
        if recipe.train.loss == "tv":
            # A fresh head overlaps the target almost nowhere, where TV's gradient vanishes.
            log.warning(
                "train.loss tv on a fresh head: it learns slowly until its draft overlaps the "
                "target's distribution (docs/experiments.md, 2026-12-06); lk trains as kl at first and "
                "turns to tv as acceptance rises, or start from a trained head with train.init_from"
            )
        cfg = head_config_for(
            recipe, target.config, verifier=verifier, tokenizer=target.tokenizer, token_freqs=freqs
        )
        return build_trainable_head(cfg, target.model, freqs), cfg
    from eyas.export.fetch import fetch_head
    from eyas.export.head_dir import target_facts
    from eyas.export.reader import load_any_head

    source_dir = fetch_head(source_name, revision=recipe.train.init_from_revision)
    embed = target.model.get_input_embeddings().weight.detach().float().cpu()
    source = load_any_head(
        source_dir,
        target_embed=embed,
        dtype=torch.float32,
        target=target_facts(target.config, f"target {recipe.target.name_or_path}"),
    )
    cfg = init_from_config(
        recipe,
        source.config,
        target.config,
        f"train.init_from {source_name}",
        verifier=verifier,
        tokenizer=target.tokenizer,
        token_freqs=freqs,
    )
    head, fresh = head_from_checkpoint(cfg, source, target.model)
    coverage = draft_vocab_coverage(head, freqs)
    log.info(
        "train.init_from %s: the %s head (%d layer(s), draft vocabulary %d) %s%s",
        source_name,
        source.config.algorithm,
        source.config.num_hidden_layers,
        cfg.draft_vocab_size,
        f"continued as a {cfg.num_hidden_layers}-layer {cfg.algorithm} head"
        + (f" ({', '.join(fresh)} fresh)" if fresh else ""),
        ""
        if coverage is None
        else f"; its draft vocabulary holds {coverage:.1%} of this data's trained tokens",
    )
    if coverage is not None and coverage < 0.9:
        log.warning(
            "train.init_from: the head's draft vocabulary holds only %.1f%% of this data's trained tokens; "
            "a fresh head (its vocabulary from this data) may draft better",
            100 * coverage,
        )
    return head, cfg
