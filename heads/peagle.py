"""The P-EAGLE head (DESIGN §4): an EAGLE-3 head whose K draft slots come from one
forward pass. Slot 0 is the last verified position (real token, real features); slots
1..K-1 carry the mask token (its embedding, `mask_embedding`, is learned) and
`mask_hidden`, one learned vector standing for the missing target features *before* `fc`.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, PositiveInt
from torch import nn

from eyas.core.sampling import sample_tokens
from eyas.heads.algorithms import Algorithm, AlgorithmSection, register
from eyas.heads.config import DraftHeadConfig
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.layers import HeadCache


class PEagleHead(Eagle3Head):
    def __init__(self, config: DraftHeadConfig):
        if config.algorithm != "peagle":
            raise ValueError("PEagleHead needs a config with algorithm='peagle'")
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.zeros(1, config.fc_in_features))
        nn.init.normal_(self.mask_hidden, std=0.02)
        # The mask token's row is the one embedding row P-EAGLE must learn. It is a parameter
        # of its own so that the table stays frozen (the target's, as for EAGLE-3) and the
        # optimizer does not carry it (the table is most of a head's weights); the head still
        # ships the table, with this row written in (`with_mask_row`), since that is what
        # vLLM reads. A head narrower or wider than the target trains its whole table.
        self.mask_embedding = nn.Parameter(self.embed_tokens.weight[config.mask_token_id].detach().clone())
        self.embed_tokens.weight.requires_grad_(config.hidden_size != config.target_hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        is_mask = (input_ids == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)

    @torch.no_grad()
    def init_from_target(self, embed, lm_head, final_norm=None) -> None:
        super().init_from_target(embed, lm_head, final_norm)
        # Start the mask row at the mean embedding: a neutral token the layers can read.
        self.mask_embedding.copy_(embed.float().mean(0).to(self.mask_embedding))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state in the serving layout (an export, a checkpoint from before mask_embedding
        # existed) holds the mask row only inside the table.
        table, own = prefix + "embed_tokens.weight", prefix + "mask_embedding"
        if own not in state_dict and table in state_dict:
            state_dict[own] = state_dict[table][self.config.mask_token_id]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def mask_slot_inputs(self, batch: int, depth: int, device):
        """Token ids `[batch, depth]` (the mask id) and fc inputs `[batch, depth, n·Ht]`."""
        ids = torch.full((batch, depth), self.config.mask_token_id, dtype=torch.long, device=device)
        return ids, self.mask_hidden.expand(batch, depth, -1)

    @torch.no_grad()
    def draft(
        self,
        cache: HeadCache,
        tokens,
        aux,
        positions,
        k: int,
        temperature: float = 0.0,
        generator=None,
        keep_going=None,
    ):
        """One-pass drafting of k tokens; same contract as `Eagle3Head.draft` (one pass
        drafts every token at once, so `keep_going` is never asked)."""
        b, n = tokens.shape
        base = cache.length + n
        mask_ids, mask_aux = self.mask_slot_inputs(b, k - 1, tokens.device)
        steps = torch.arange(1, k, device=positions.device)[None, :]
        all_tokens = torch.cat([tokens, mask_ids], dim=1)
        all_aux = torch.cat([aux.to(mask_aux.dtype), mask_aux], dim=1)
        all_pos = torch.cat([positions, positions[:, -1:] + steps], dim=1)
        logits, _ = self.forward_step(all_tokens, self.combine_aux(all_aux), all_pos, cache)
        logits = logits[:, n - 1 :]
        cache.crop(base)
        flat = sample_tokens(logits.reshape(b * k, -1), temperature, generator=generator).view(b, k)
        return self.to_target_ids(flat), logits


def with_mask_row(state: dict[str, torch.Tensor], mask_token_id: int) -> dict[str, torch.Tensor]:
    """A P-EAGLE state dict in the serving layout: `mask_embedding` written into row
    `mask_token_id` of a copy of `embed_tokens.weight` and dropped. Other states pass as
    they are."""
    if "mask_embedding" not in state:
        return state
    state = dict(state)
    row = state.pop("mask_embedding")
    if "embed_tokens.weight" in state:
        table = state["embed_tokens.weight"].clone()
        table[mask_token_id] = row.to(table.dtype)
        state["embed_tokens.weight"] = table
    return state


def choose_mask_token_id(
    tokenizer, vocab_size: int, explicit: int | None = None, token_freqs: torch.Tensor | None = None
) -> int:
    """The token id whose embedding row P-EAGLE trains as its mask slot, in this order:
    `explicit` (the recipe's head.mask_token_id); the tokenizer's mask token; the first
    embedding row past the tokenizer (an id no text produces); a token named "reserved";
    an added token that is not one of the tokenizer's named special tokens (the rarest in
    `token_freqs` [Vt] when given, else the highest id); the rarest id in `token_freqs`.
    Raises ValueError when none applies: then the recipe must name one."""

    def check(i: int, what: str) -> int:
        if not 0 <= int(i) < vocab_size:
            raise ValueError(f"{what} mask_token_id {i} lies outside the target vocabulary [0, {vocab_size})")
        return int(i)

    if explicit is not None:
        return check(explicit, "head.mask_token_id:")
    if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        if tokenizer.mask_token_id < vocab_size:
            return int(tokenizer.mask_token_id)

    def rarest(ids: list[int]) -> int:
        if token_freqs is None:
            return max(ids)
        freqs = token_freqs[torch.tensor(ids, dtype=torch.long)].float()
        low = freqs.min()
        return max(i for i, f in zip(ids, freqs.tolist()) if f == low)

    if tokenizer is not None:
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        added = {tok: i for tok, i in tokenizer.get_added_vocab().items() if 0 <= i < vocab_size}
        reserved = [i for tok, i in added.items() if "reserved" in tok.lower()]
        if reserved:
            return rarest(reserved) if token_freqs is not None else min(reserved)
        named = set(getattr(tokenizer, "all_special_ids", []) or [])
        spare = [i for i in added.values() if i not in named]
        if spare:
            return rarest(spare)
    if token_freqs is not None:
        return rarest(list(range(vocab_size)))
    raise ValueError(
        "cannot choose a P-EAGLE mask token: the tokenizer has no mask, unused or reserved token; "
        "set head.mask_token_id in the recipe"
    )


class PEagleTraining(AlgorithmSection):
    """`train.peagle`: COD sampling over the draft depths (DESIGN §4)."""

    num_depths: int = Field(8, ge=1)
    cod_r: float = Field(0.8, gt=0, le=1)
    cod_r_min: float = Field(0.2, ge=0, le=1)
    segment_length: PositiveInt | None = None
    # "element": the mean over every kept element, so depth 0 (every anchor) outweighs the
    # sparsely kept deep ones; "depth": each depth's mean counts the same, so a warm-started
    # head spends its training on the depths it cannot draft yet.
    loss_weighting: Literal["element", "depth"] = "element"
    # True: deeper elements (d >= 1) are drawn only where they or a deeper element of their
    # chain carry a label (an element whose chain lies in the prompt adds no loss and no key
    # any labelled element reads; DESIGN §4). Off by default: it measured no better than
    # drawing at every position (docs/experiments.md, 2026-12-06).
    cod_labelled_only: bool = False

    ACTIVATIONS = "P-EAGLE COD activations"

    def activation_copies(self) -> float:
        """The elements COD keeps per token: depth d keeps a share max(r_min, r^d)."""
        return sum(max(self.cod_r_min, self.cod_r**d) for d in range(self.num_depths))


PEAGLE = register(
    Algorithm(
        name="peagle",
        head_class=PEagleHead,
        training=PEagleTraining,
        loss="eyas.train.peagle:peagle_loss",
        speculators_architecture="PEagleSpeculator",
        parallel_drafting=True,
        trains_embedding=True,
        needs_mask_token=True,
        typical_num_layers=4,
        card_title="P-EAGLE (parallel drafting)",
        card_tag="p-eagle",
        eagle_layout_default=True,
    )
)
