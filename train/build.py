"""Assemble what a run trains: the head shaped from the recipe and the target, its draft
vocabulary from token frequencies, its initial weights from the target, and the frozen
target output layers (final norm + LM head) the labels are computed with."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from eyas.data.targets import default_aux_layer_ids, target_norm_and_lm_head, text_config
from eyas.heads.config import DraftHeadConfig, head_config_from_target
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.peagle import build_head, choose_mask_token_id
from eyas.heads.vocab import build_vocab_map

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


def head_config_for(recipe, target_config, verifier: str | None = None, tokenizer=None,
                    token_freqs: torch.Tensor | None = None) -> DraftHeadConfig:
    """The head config of a recipe's `head` section over the target's HF config. A P-EAGLE
    head without an explicit mask id gets one from `choose_mask_token_id` (the tokenizer's
    mask token, else an unused or reserved id; never pad/EOS, whose rows the target uses)."""
    h = recipe.head
    mask_id = h.mask_token_id
    if h.draft_vocab_size > (vocab := text_config(target_config).vocab_size):
        log.warning("head.draft_vocab_size %d is above the target's vocabulary (%d): the head drafts over the "
                    "whole target vocabulary, with no draft-vocabulary map", h.draft_vocab_size, vocab)
    if h.algorithm == "peagle":
        mask_id = choose_mask_token_id(tokenizer, text_config(target_config).vocab_size, explicit=mask_id,
                                       token_freqs=token_freqs)
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
    )


def fit_frequencies(freqs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token counts [>=Vt or <Vt] -> [Vt]: ids past the target's vocabulary (tokenizer
    extras) cannot be drafted; missing ids count 0."""
    freqs = torch.as_tensor(freqs).flatten()
    if freqs.numel() >= vocab_size:
        return freqs[:vocab_size]
    return torch.cat([freqs, freqs.new_zeros(vocab_size - freqs.numel())])


def build_trainable_head(config: DraftHeadConfig, target_model: nn.Module, freqs: torch.Tensor | None) -> Eagle3Head:
    """A float32 head with its vocabulary map set (from `freqs` [Vt], the masked-token
    counts) and its embedding / LM head rows / final norm copied from the target."""
    norm, lm_head = target_norm_and_lm_head(target_model)
    embed = target_model.get_input_embeddings().weight
    return head_from_target_weights(config, freqs, embed.detach(), lm_head.weight.detach(), norm.weight.detach())


def head_from_target_weights(config: DraftHeadConfig, freqs: torch.Tensor | None, embed: torch.Tensor,
                             lm_head_weight: torch.Tensor, norm_weight: torch.Tensor) -> Eagle3Head:
    """`build_trainable_head` from the target's tensors alone: embed / lm_head_weight
    [Vt, Ht], norm_weight [Ht] (benchmarks build heads at a target's shape without it)."""
    head = build_head(config).float()
    if config.uses_vocab_map:
        if freqs is None:
            raise ValueError("a draft vocabulary smaller than the target's needs token frequencies "
                             "(run `eyas prepare`: prepared/token_freqs.safetensors)")
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
