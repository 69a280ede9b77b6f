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

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

import torch

from eyas.data.decode import decode_replies_hf
from eyas.data.fed_states import write_fed_states
from eyas.data.templates import prompt_ids

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
