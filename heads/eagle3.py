"""The EAGLE-3 draft head (DESIGN §3) and its KV-cache drafting path.

Parameter names are those of the serving contract (DESIGN §5) so export is a rename-free
copy: `fc`, `layers.{i}.*`, `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`,
`fc_norm.{i}` / `input_norm`.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import nn

from eyas.core.sampling import sample_tokens
from eyas.heads.algorithms import Algorithm, AlgorithmSection, register
from eyas.heads.config import DraftHeadConfig
from eyas.heads.layers import DecoderLayer, HeadCache, RMSNorm


class Eagle3Head(nn.Module):
    """Fused-feature draft head.

    One step: `forward_step(input_ids [B,T], hidden [B,T,H], positions [B,T], cache, mask)`
    -> `(logits [B,T,Vd], hidden_out [B,T,H])`. At step 0 `hidden` is
    `combine_aux(aux [B,T,n·Ht])`; at later steps it is the previous step's `hidden_out`.
    """

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.config = config
        h, ht, n = config.hidden_size, config.target_hidden_size, config.num_aux
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(self.trains_embedding)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(ht, config.rms_norm_eps) for _ in range(n))
        if config.norm_before_fc:
            self.input_norm = RMSNorm(n * ht, config.rms_norm_eps)
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, first=i == 0) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if config.uses_vocab_map:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @property
    def trains_embedding(self) -> bool:
        # Whether the table is the head's own (stored, exported) rather than the target's. A
        # head narrower/wider than the target cannot share the target's embedding; a P-EAGLE
        # head owns its table for the mask row, which alone it learns (heads/peagle.py).
        return self.config.trains_embedding or self.config.hidden_size != self.config.target_hidden_size

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)

    # --- vocabulary -----------------------------------------------------------------

    def set_vocab_map(self, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> None:
        if not self.config.uses_vocab_map:
            if d2t is not None:
                raise ValueError("draft vocabulary equals the target's: the head takes no d2t/t2d")
            return
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def draft_token_ids(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary rows."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device)
        return ids + self.d2t if self.config.uses_vocab_map else ids

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.config.uses_vocab_map else draft_ids

    @torch.no_grad()
    def init_from_target(
        self, embed: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor | None = None
    ) -> None:
        """Copy the target's embedding `[Vt, Ht]`, its `lm_head` rows of the draft
        vocabulary `[Vt, Ht] -> [Vd, H]` and its final norm (when H == Ht)."""
        if self.config.hidden_size != self.config.target_hidden_size:
            return
        self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight))
        rows = self.draft_token_ids().to(lm_head.device)
        self.lm_head.weight.copy_(lm_head[rows].to(self.lm_head.weight))
        if final_norm is not None:
            self.norm.weight.copy_(final_norm.to(self.norm.weight))

    # --- forward --------------------------------------------------------------------

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n·Ht] (chunks in ascending layer-id order) -> g [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            chunks = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        elif self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, H] of `input_ids` [B, T]."""
        return self.embed_tokens(input_ids)

    def forward_layers(self, input_ids, hidden, positions, cache: HeadCache, mask=None) -> torch.Tensor:
        """The decoder layers of one head step over T slots, up to the final norm: the
        pre-norm state `[B, T, H]`; keys are appended to `cache`. The one layer loop both
        `forward_step` (drafting, serving) and the training loss run, so they cannot drift."""
        embeds = self.embed(input_ids)
        h = hidden
        for layer, layer_cache in zip(self.layers, cache.layers):
            h = layer(h, positions, layer_cache, mask, embeds=embeds if layer.first else None)
        return h

    def forward_step(self, input_ids, hidden, positions, cache: HeadCache, mask=None):
        """One head step over T slots; keys are appended to `cache`.

        Returns logits over the draft vocabulary `[B, T, Vd]` and the hidden state fed to
        the next step `[B, T, H]` (pre-norm, or normed with `norm_output`)."""
        h = self.forward_layers(input_ids, hidden, positions, cache, mask)
        normed = self.norm(h)
        return self.lm_head(normed), (normed if self.config.norm_output else h)

    def new_cache(self) -> HeadCache:
        return HeadCache(len(self.layers))

    # --- drafting -------------------------------------------------------------------

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
        """Chain drafting, one head step per draft token.

        `tokens/aux/positions` `[B, n]` are the step-0 entries committed since the last
        call (slot t carries token x_{t+1} and the target's features at t); the last is
        the newest verified slot p. Returns `(draft target ids [B, k], draft logits
        [B, k, Vd])`; the cache keeps only step-0 entries afterwards. `keep_going(j, ids
        [B])`, asked after step j (not the last), may end the chain early: the ids and
        logits returned then cover the steps taken (a replay stops at the first draft the
        target rejects: nothing after it is accepted).
        """
        base = cache.length + tokens.shape[1]
        logits, hid = self.forward_step(tokens, self.combine_aux(aux), positions, cache)
        logits, hid = logits[:, -1:], hid[:, -1:]
        pos = positions[:, -1:]
        all_logits, ids = [], []
        for j in range(k):
            all_logits.append(logits[:, 0])
            tok = sample_tokens(logits[:, 0], temperature, generator=generator)
            ids.append(self.to_target_ids(tok))
            if j + 1 == k or (keep_going is not None and not keep_going(j, ids[-1])):
                break
            logits, hid = self.forward_step(ids[-1][:, None], hid, pos + j + 1, cache)
        cache.crop(base)
        return torch.stack(ids, dim=1), torch.stack(all_logits, dim=1)


class Eagle3Training(AlgorithmSection):
    """`train.eagle3`: the training-time test (DESIGN §3)."""

    ttt_steps: int = Field(7, ge=1)
    ttt_decay: float = Field(0.8, gt=0)
    # Weight of the copy supervision of attention head 0 (train/copy_attention.py); 0 trains
    # on the soft-label loss alone.
    copy_attention_weight: float = Field(0.0, ge=0)
    # ... on TTT steps 0..copy_attention_steps-1 (at most ttt_steps)
    copy_attention_steps: int = Field(1, ge=1)

    ACTIVATIONS = "EAGLE-3 TTT activations"

    def activation_copies(self) -> float:
        return self.ttt_steps  # every unrolled step keeps its pass's activations

    @model_validator(mode="after")
    def _copy_steps_within_ttt(self) -> Eagle3Training:
        if self.copy_attention_steps > self.ttt_steps:
            raise ValueError(
                f"copy_attention_steps ({self.copy_attention_steps}) exceeds ttt_steps "
                f"({self.ttt_steps}): there is no attention to supervise there"
            )
        return self


EAGLE3 = register(
    Algorithm(
        name="eagle3",
        head_class=Eagle3Head,
        training=Eagle3Training,
        loss="eyas.train.eagle3:eagle3_loss",
        speculators_architecture="Eagle3Speculator",
        card_title="EAGLE-3",
        norm_before_residual_default=False,
        eagle_layout_default=True,
    )
)
