"""Batched greedy or sampled decoding with the target's own KV cache (the hf backend of
regeneration): prompts left padded, finished rows leaving the batch, the cache written in
place, and optionally the states of every fed token kept for the capture
(data/fed_states.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eyas.core.sampling import sample_tokens
from eyas.target.features import capture_aux
from eyas.target.load import stop_token_ids


@functools.cache
def _preallocated_layer_class():
    """A transformers `DynamicLayer` that writes into buffers grown by doubling instead of
    concatenating at every call; None where transformers has no per-layer cache objects."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._used = 0
                self._kbuf = self._vbuf = None
            b, h, n, _ = key_states.shape
            if self._kbuf is None or self._used + n > self._kbuf.shape[2]:
                size = max(self.capacity, 2 * (self._used + n))
                kbuf = key_states.new_empty(b, h, size, key_states.shape[-1])
                vbuf = value_states.new_empty(b, h, size, value_states.shape[-1])
                if self._used:
                    kbuf[:, :, : self._used], vbuf[:, :, : self._used] = self.keys, self.values
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, self._used : self._used + n] = key_states
            self._vbuf[:, :, self._used : self._used + n] = value_states
            self._used += n
            self.keys, self.values = self._kbuf[:, :, : self._used], self._vbuf[:, :, : self._used]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            if self.is_initialized and self._used:
                self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
                self.keys, self.values = self._kbuf[:, :, : self._used], self._vbuf[:, :, : self._used]

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            if self.is_initialized and self.keys is not None and self.keys.numel():
                self._used = self.keys.shape[2]

    return PreallocatedLayer


def _preallocated_cache(model, capacity: int):
    """A `DynamicCache` whose full-attention layers write into buffers of `capacity`
    positions instead of concatenating: `DynamicLayer.update` copies the whole cache at
    every decode step (a third of a batch-64 SmolLM2 step on CPU at 150 positions, more
    as replies grow). Sliding-window layers, and transformers versions without per-layer
    cache objects, keep their own behaviour."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layer_class = _preallocated_layer_class()
    layers = getattr(cache, "layers", None)
    if layer_class is None or not layers:
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is layer_class.__base__:
            layers[i] = layer_class(capacity)
    return cache


def _takes_additive_decode_mask(model) -> bool:
    """Whether decode steps may hand the model a ready 4D additive mask: SDPA attention and
    no sliding-window layers (a 4D mask is used as is for every layer, so a sliding layer
    would attend to its whole cache)."""
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(cfg, "layer_types", None) or []
    return getattr(cfg, "sliding_window", None) is None and all(t == "full_attention" for t in layer_types)


def _additive_decode_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, L] (1 = token) -> [B, 1, 1, L] of 0 / dtype-min for one decode query. SDPA
    on CPU runs ~2x faster on an additive mask than on the boolean one transformers builds
    from a 2D mask (the attention is ~30% of a batch-256 SmolLM2 decode step)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask == 0, torch.finfo(dtype).min)[:, None, None, :]


@dataclass
class DecodedReply:
    """One reply of `decode_replies_hf`. `token_ids`: the sampled tokens, stop token
    excluded; `finished`: a stop token ended it (else max_new_tokens did); `text`: the
    tokens decoded (special tokens removed, stripped). With recorded
    states, `fed_ids` is the prompt followed by `token_ids` and `states` `[len(fed_ids),
    n*Ht]` the hooked states of each of those tokens (see `decode_replies_hf`)."""

    token_ids: list[int]
    text: str
    finished: bool = True
    fed_ids: list[int] | None = None
    states: torch.Tensor | None = None


@torch.no_grad()
def decode_replies_hf(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None = None,
    state_layer_ids: Sequence[int] | None = None,
) -> list[DecodedReply]:
    """Batched decoding of `prompts` (token id lists) with the target's KV cache.

    Prompts are left padded so every row's next token sits in the last column. Rows that
    emitted a stop token leave the batch (their cache rows dropped) once they are a
    quarter of it, so a batch costs about what its live rows need rather than
    `len(prompts) x max_new_tokens` slots as with `model.generate`, which keeps finished
    rows until the longest reply ends.

    `state_layer_ids` (ids as `capture_aux`: i < L the input of decoder layer i, L the
    last state before the final norm): also keep, in bf16, the states of every token the
    target was fed, prompt and reply, so a capture can copy them instead of running the
    target again. A reply cut at `max_new_tokens` gets one more forward for its last token.
    """
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = torch.tensor(sorted(stop_token_ids(model, tokenizer)), dtype=torch.long, device=device)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = _preallocated_cache(model, width + max_new_tokens)
    dtype = next(model.parameters()).dtype
    additive = _takes_additive_decode_mask(model)
    rows = torch.arange(len(prompts), device=device)  # original index of each batch row
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    last_pos = positions[:, -1]
    replies: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)  # a stop token ended the reply (not max_new_tokens)
    states = (
        None  # [B, width + max_new_tokens, C]: prompt states left padded as `ids`, reply token s at width + s
    )
    with capture_aux(model, state_layer_ids or []) as grabbed:
        # The base model, then the LM head on the last column only: `logits_to_keep=1` hands
        # the LM head a strided [B, 1, H] slice, which on CPU becomes a batched matmul against
        # B copies of the [V, H] weight (seconds per batch for a 49k vocabulary).
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        hidden = base(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        ).last_hidden_state[:, -1]
        logits = model.get_output_embeddings()(hidden.contiguous())
        if state_layer_ids:
            prefill = grabbed.pop("aux")
            states = torch.empty(
                len(prompts), width + max_new_tokens, prefill.shape[-1], dtype=torch.bfloat16
            )
            states[:, :width] = prefill.to("cpu", torch.bfloat16)
            del prefill

        def feed(nxt, step):
            """One decode forward of the current rows' tokens `nxt` (reply token `step`);
            returns the logits of the next token [B_cur, V]."""
            nonlocal mask, last_pos
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            last_pos = last_pos + 1
            step_mask = _additive_decode_mask(mask, dtype) if additive else mask
            out = model(
                input_ids=nxt[:, None],
                attention_mask=step_mask,
                position_ids=last_pos[:, None],
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
            if states is not None:
                # only the rows whose token is a reply token (not a stop, not a finished row's filler)
                fed = grabbed.pop("aux")[:, 0]
                states[rows[live].cpu(), width + step] = fed[live].to("cpu", torch.bfloat16)
            return out

        for step in range(max_new_tokens):
            nxt = sample_tokens(logits, temperature, top_p, generator)
            stopped = torch.isin(nxt, stops) | ~live
            for r, tok, stop, was_live in zip(rows.tolist(), nxt.tolist(), stopped.tolist(), live.tolist()):
                if not stop:
                    replies[r].append(tok)
                elif was_live:
                    finished[r] = True
            live = ~stopped
            n_live = int(live.sum())
            if n_live == 0:
                break
            if step + 1 == max_new_tokens:
                if states is not None:  # the last token of the cut replies: its state labels what follows
                    feed(nxt, step)
                break
            if len(live) - n_live >= max(1, len(live) // 4):
                keep = live.nonzero()[:, 0]
                cache.batch_select_indices(keep)
                rows, mask, nxt, last_pos, live = (
                    rows[keep],
                    mask[keep],
                    nxt[keep],
                    last_pos[keep],
                    live[keep],
                )
            logits = feed(nxt, step)
    out = []
    for b, (p, r) in enumerate(zip(prompts, replies)):
        text = tokenizer.decode(r, skip_special_tokens=True).strip()
        if states is None:
            out.append(DecodedReply(token_ids=r, text=text, finished=finished[b]))
        else:
            out.append(
                DecodedReply(
                    token_ids=r,
                    text=text,
                    finished=finished[b],
                    fed_ids=list(p) + r,
                    states=states[b, width - len(p) : width + len(r)].clone(),
                )
            )
    return out
