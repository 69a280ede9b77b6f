"""Regeneration: replace the assistant turns of conversations with the target's own
replies, since a draft head learns the target's distribution, not the dataset's.

Multi-turn conversations are regenerated turn by turn: reply k is generated from the
history whose earlier replies are already the target's own, so every trained turn is
conditioned as at serving time. Output is a JSONL file, one `{"index", "source",
"messages"}` record per conversation (`source`: a digest of the turns it was generated
from), appended and fsynced after every batch; a rerun keeps the whole records already
there whose source still matches the conversation at that index (a cut-off last line is
ignored, a record of other data is generated again) and continues after them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from eyas.data.fed_states import write_fed_states
from eyas.data.targets import capture_aux, stop_token_ids
from eyas.data.templates import prompt_ids
from eyas.sampling import sample_tokens

log = logging.getLogger(__name__)


def source_digest(conversation: list[dict]) -> str:
    """What a reply record was generated from: a digest of the user and system turns."""
    key = [[m["role"], m["content"]] for m in conversation if m["role"] != "assistant"]
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:16]


def _done_records(path: Path) -> dict[int, tuple[str, list[dict]]]:
    """Whole records already written, index -> (source digest, messages); a line cut off
    by a kill is removed from the file so appending continues on a fresh line."""
    done = {}
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    done[int(rec["index"])] = (rec.get("source", ""), rec["messages"])
                except (json.JSONDecodeError, KeyError, ValueError, TypeError):
                    continue  # the line a kill cut off
    return done


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
                    kbuf[:, :, :self._used], vbuf[:, :, :self._used] = self.keys, self.values
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, self._used:self._used + n] = key_states
            self._vbuf[:, :, self._used:self._used + n] = value_states
            self._used += n
            self.keys, self.values = self._kbuf[:, :, :self._used], self._vbuf[:, :, :self._used]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            if self.is_initialized and self._used:
                self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
                self.keys, self.values = self._kbuf[:, :, :self._used], self._vbuf[:, :, :self._used]

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
    excluded; `text`: them decoded (special tokens removed, stripped). With recorded
    states, `fed_ids` is the prompt followed by `token_ids` and `states` `[len(fed_ids),
    n*Ht]` the hooked states of each of those tokens (see `decode_replies_hf`)."""

    token_ids: list[int]
    text: str
    fed_ids: Optional[list[int]] = None
    states: Optional[torch.Tensor] = None


@torch.no_grad()
def generate_replies_hf(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                        top_p: float, generator: Optional[torch.Generator] = None) -> list[str]:
    """The reply texts of `decode_replies_hf`."""
    return [r.text for r in decode_replies_hf(model, tokenizer, prompts, max_new_tokens, temperature, top_p,
                                              generator)]


@torch.no_grad()
def decode_replies_hf(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                      top_p: float, generator: Optional[torch.Generator] = None,
                      state_layer_ids: Optional[Sequence[int]] = None) -> list[DecodedReply]:
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
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = _preallocated_cache(model, width + max_new_tokens)
    dtype = next(model.parameters()).dtype
    additive = _takes_additive_decode_mask(model)
    rows = torch.arange(len(prompts), device=device)  # original index of each batch row
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    last_pos = positions[:, -1]
    replies: list[list[int]] = [[] for _ in prompts]
    states = None  # [B, width + max_new_tokens, C]: prompt states left padded as `ids`, reply token s at width + s
    with capture_aux(model, state_layer_ids or []) as grabbed:
        # The base model, then the LM head on the last column only: `logits_to_keep=1` hands
        # the LM head a strided [B, 1, H] slice, which on CPU becomes a batched matmul against
        # B copies of the [V, H] weight (seconds per batch for a 49k vocabulary).
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        hidden = base(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=True).last_hidden_state[:, -1]
        logits = model.get_output_embeddings()(hidden.contiguous())
        if state_layer_ids:
            prefill = grabbed.pop("aux")
            states = torch.empty(len(prompts), width + max_new_tokens, prefill.shape[-1], dtype=torch.bfloat16)
            states[:, :width] = prefill.to("cpu", torch.bfloat16)
            del prefill

        def feed(nxt, step):
            """One decode forward of the current rows' tokens `nxt` (reply token `step`);
            returns the logits of the next token [B_cur, V]."""
            nonlocal mask, last_pos
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            last_pos = last_pos + 1
            step_mask = _additive_decode_mask(mask, dtype) if additive else mask
            out = model(input_ids=nxt[:, None], attention_mask=step_mask, position_ids=last_pos[:, None],
                        cache=cache, use_cache=True).logits[:, -1]
            if states is not None:
                # only the rows whose token is a reply token (not a stop, not a finished row's filler)
                fed = grabbed.pop("aux")[:, 0]
                states[rows[live].cpu(), width + step] = fed[live].to("cpu", torch.bfloat16)
            return out

        for step in range(max_new_tokens):
            nxt = sample_tokens(logits, temperature, top_p, generator)
            stopped = torch.isin(nxt, stops) | ~live
            for r, tok, stop in zip(rows.tolist(), nxt.tolist(), stopped.tolist()):
                if not stop:
                    replies[r].append(tok)
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
                rows, mask, nxt, last_pos, live = rows[keep], mask[keep], nxt[keep], last_pos[keep], live[keep]
            logits = feed(nxt, step)
    out = []
    for b, (p, r) in enumerate(zip(prompts, replies)):
        text = tokenizer.decode(r, skip_special_tokens=True).strip()
        if states is None:
            out.append(DecodedReply(token_ids=r, text=text))
        else:
            out.append(DecodedReply(token_ids=r, text=text, fed_ids=list(p) + r,
                                    states=states[b, width - len(p):width + len(r)].clone()))
    return out


def generate_replies_vllm(llm, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                          top_p: float, seed: int) -> list[str]:
    """The same with a vLLM engine (`vllm.LLM`), when installed."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outs]


def before_first_reply(conversation: list[dict]) -> list[dict]:
    """The messages before the first assistant turn: what its reply is generated from."""
    out = []
    for m in conversation:
        if m["role"] == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    return out


def regenerate(
    conversations: Sequence[list[dict]],
    tokenizer,
    out_path: str | Path,
    model=None,
    backend: str = "hf",
    batch_size: int = 16,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    vllm_model: Optional[str] = None,
    progress: bool = True,
    max_prompt_tokens: Optional[int] = None,
    states_dir: Optional[str | Path] = None,
    state_layer_ids: Optional[Sequence[int]] = None,
    target_name: str = "",
) -> list[list[dict]]:
    """Regenerate every assistant turn; returns the new conversations (in input order).

    With `states_dir` and `state_layer_ids` (the hf backend only), the states the target
    computed for each conversation's last kept reply and its prompt are written there
    before the batch's records (data/fed_states.py), for the capture to copy.

    Replies that come back empty (the target stopped at once) keep the turn out of the
    result by ending the conversation before it; a conversation left without any
    assistant turn is dropped by the caller's renderer. A turn whose prompt is longer
    than `max_prompt_tokens` ends its conversation too: its sample could not fit the
    training length, so generating it would be wasted work.
    """
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sources = [source_digest(c) for c in conversations]
    records = _done_records(out_path)
    # a record whose source differs came from other data (another max_samples, dedupe,
    # max_turns): generated again, and the later record wins on the next read
    done = {i: msgs for i, (src, msgs) in records.items() if i < len(conversations) and src == sources[i]}
    stale = sum(1 for i in records if i not in done)
    if stale:
        log.warning("%s: %d records were generated from other conversations than these; generating them again",
                    out_path, stale)
    todo = [i for i in range(len(conversations)) if i not in done]
    # Batches are formed by the token length of the first prompt to generate from, so left
    # padding wastes little: sorting by characters of the first two messages let the
    # dataset's own reply decide, which left ~60% of prefill positions padding.
    # Conversations whose first prompt is already over the cap take no batch slot.
    first_prompt = {i: prompt_ids(tokenizer, before_first_reply(conversations[i])) for i in todo}
    cap = max_prompt_tokens if max_prompt_tokens is not None else float("inf")
    too_long = [i for i in todo if len(first_prompt[i]) > cap]
    todo = sorted((i for i in todo if len(first_prompt[i]) <= cap), key=lambda i: len(first_prompt[i]))
    torch.manual_seed(seed)
    llm = None
    if backend == "vllm":
        from vllm import LLM

        llm = LLM(model=vllm_model, seed=seed)
    bar = tqdm(total=len(conversations), initial=len(done), desc="regenerate",
               unit="conv", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        if too_long:  # ended before their first reply, as the loop below would end them
            for i in too_long:
                f.write(json.dumps({"index": i, "source": sources[i], "messages": []}) + "\n")
                done[i] = []
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(too_long))
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            histories = {i: [] for i in batch}
            fed: dict[int, tuple[list[int], torch.Tensor]] = {}  # conversation -> its last kept reply's call
            alive = set(batch)
            max_turns = max(len(conversations[i]) for i in batch)
            for t in range(max_turns):
                # Turn t of every conversation in the batch: copy user/system turns, generate assistant ones.
                need = []
                for i in batch:
                    conv = conversations[i]
                    if i not in alive or t >= len(conv):
                        continue
                    if conv[t]["role"] == "assistant":
                        need.append(i)
                    else:
                        histories[i].append({"role": conv[t]["role"], "content": conv[t]["content"]})
                if not need:
                    continue
                # A conversation's first prompt was tokenised for sorting; later ones are built here.
                prompts = [first_prompt.pop(i, None) or prompt_ids(tokenizer, histories[i]) for i in need]
                if max_prompt_tokens is not None:
                    fits = [len(p) <= max_prompt_tokens for p in prompts]
                    alive.difference_update(i for i, ok in zip(need, fits) if not ok)
                    need = [i for i, ok in zip(need, fits) if ok]
                    prompts = [p for p, ok in zip(prompts, fits) if ok]
                    if not need:
                        continue
                if llm is not None:
                    replies = generate_replies_vllm(llm, tokenizer, prompts, max_new_tokens, temperature, top_p, seed)
                else:
                    decoded = decode_replies_hf(model, tokenizer, prompts, max_new_tokens, temperature, top_p,
                                                state_layer_ids=state_layer_ids if states_dir is not None else None)
                    replies = [d.text for d in decoded]
                    fed.update((i, (d.fed_ids, d.states)) for i, d in zip(need, decoded)
                               if d.text and d.states is not None)
                for i, reply in zip(need, replies):
                    if reply:
                        histories[i].append({"role": "assistant", "content": reply})
                    else:
                        alive.discard(i)
            for i in batch:
                while histories[i] and histories[i][-1]["role"] != "assistant":
                    histories[i].pop()
            if fed:  # before the records: a kill in between regenerates these, never records without states
                write_fed_states(states_dir, {i: fed[i] for i in batch if i in fed and histories[i]},
                                 state_layer_ids, target_name)
            for i in batch:
                f.write(json.dumps({"index": i, "source": sources[i], "messages": histories[i]},
                                   ensure_ascii=False) + "\n")
                done[i] = histories[i]
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()
    return [done[i] for i in range(len(conversations))]
