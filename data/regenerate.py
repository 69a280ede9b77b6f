"""Regeneration: replace the assistant turns of conversations with the target's own
replies, since a draft head learns the target's distribution, not the dataset's.

Multi-turn conversations are regenerated turn by turn: reply k is generated from the
history whose earlier replies are already the target's own, so every trained turn is
conditioned as at serving time. Output is a JSONL file, one `{"index", "source",
"messages"}` record per conversation (`source`: a digest of the turns it was generated
from), appended and fsynced after every batch (hf) or as conversations finish (server); a
rerun keeps the whole records already there whose source still matches the conversation
at that index (a cut-off last line is ignored, a record of other data is generated again)
and continues after them.

Two backends (DESIGN §2.1): `hf` decodes in this process (data/decode.py), `server`
asks an OpenAI-compatible engine (data/regenerate_server.py). Both store replies through
data/reasoning.py, so reasoning (harmony analysis, `<think>`) lands in the message's
`reasoning`, never in its `content`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from eyas.core.length_batches import pack_group
from eyas.core.record_log import read_records
from eyas.data.decode import decode_replies_hf
from eyas.data.fed_states import write_fed_states
from eyas.data.reasoning import (
    conversation_effort,
    decoded_reply,
    draw_efforts,
    is_empty_reply,
    is_harmony_tokenizer,
)
from eyas.data.regenerate_settings import RegenerationSettings
from eyas.data.templates import prompt_ids
from eyas.data.tool_text import as_served, calls_mode
from eyas.data.tools import copy_until_reply

log = logging.getLogger(__name__)


def source_digest(conversation: list[dict], shaping: dict | None = None) -> str:
    """What a reply record was generated from: a digest of the user, system and tool turns
    (and the tool definitions, where there are some) and of the settings that shape the
    replies (`shaping`: target, backend, lengths including the prompt cap, sampling, seed,
    reasoning effort), so a changed recipe never reuses another recipe's replies."""
    key = [[m["role"], m["content"]] for m in conversation if m["role"] != "assistant"]
    if conversation and conversation[0].get("tools"):
        key.append(conversation[0]["tools"])
    if shaping:
        key.append(sorted(shaping.items()))
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:16]


def done_records(path: Path) -> dict[int, dict]:
    """Whole records already written, index -> record; a line cut off by a kill is
    removed from the file so appending continues on a fresh line."""
    done = {}
    for rec in read_records(path)[0]:
        try:
            done[int(rec["index"])] = {
                "source": rec.get("source", ""),
                "messages": rec["messages"],
                "token_checks": rec.get("token_checks") or {},
            }
        except (KeyError, ValueError, TypeError):
            continue  # not a record of this file: its index is generated again
    return done


class RecordWriter:
    """Appends records to regenerated.jsonl; `sync` flushes and fsyncs them."""

    def __init__(self, f, sources: list[str], done: dict[int, dict], sync_every_s: float = 1.0):
        self.f, self.sources, self.done, self.sync_every_s = f, sources, done, sync_every_s
        self.last_sync = time.monotonic()

    def write(self, i: int, messages: list[dict], token_checks: dict | None = None) -> None:
        rec = {"index": i, "source": self.sources[i], "messages": messages}
        effort = conversation_effort(messages)
        if effort:
            rec["reasoning_effort"] = effort
        if token_checks:
            rec["token_checks"] = token_checks
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.done[i] = {"source": self.sources[i], "messages": messages, "token_checks": token_checks or {}}

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.last_sync = time.monotonic()

    def write_soon(self, i: int, messages: list[dict], token_checks: dict | None = None) -> None:
        """Write, and sync when the last sync is `sync_every_s` old (one fsync per record
        would bound a fast server's throughput)."""
        self.write(i, messages, token_checks)
        if time.monotonic() - self.last_sync >= self.sync_every_s:
            self.sync()


def expected_tokens(conversation: list[dict], first_prompt_tokens: int, max_new_tokens: int) -> int:
    """The work a conversation's regeneration is counted as on the progress bar: its first
    prompt's tokens and `max_new_tokens` per reply (a batch decodes until its longest
    reply ends, mostly at the cap)."""
    replies = sum(1 for m in conversation if m["role"] == "assistant")
    return first_prompt_tokens + replies * max_new_tokens


def before_first_reply(conversation: list[dict]) -> list[dict]:
    """The messages before the first assistant turn: what its reply is generated from
    (the first keeps the conversation's tool definitions)."""
    out = []
    for m in conversation:
        if m["role"] == "assistant":
            break
        out.append(dict(m))
    return out


def regenerate(
    conversations: Sequence[list[dict]],
    tokenizer,
    out_path: str | Path,
    settings: RegenerationSettings,
    model=None,
    token_checks: Counter | None = None,
    only: Sequence[int] | None = None,
) -> list[list[dict]]:
    """Regenerate every assistant turn; returns the new conversations (in input order).

    `settings.backend` "hf" decodes with `model` in batches of `settings.batch_size`;
    "server" sends the turns to the engine `settings.server` (a `ServerSettings`)
    describes. With `states_dir` and `state_layer_ids` (the hf backend only), the states
    the target computed for each conversation's last kept reply and its prompt are written
    there before the batch's records (data/fed_states.py), for the capture to copy.
    `token_checks`, when given,
    gets the server's token-id comparisons of the returned conversations, the resumed
    ones included. `only` limits the work to those indices (the others come back as
    they were, or as already regenerated): the time-budget probe runs one batch this way.
    `reasoning_effort`: one effort or a mix {effort: weight} drawn per conversation with
    `seed` (data/reasoning.py::draw_efforts); each conversation is prompted at its effort
    and its assistant turns are marked with it, so rendering uses the same template
    arguments. Sampling is seeded by `seed` (the server backend: per conversation and turn).

    Replies that come back empty (the target stopped at once, or was cut inside its
    reasoning) end the conversation before that turn; a conversation left without any
    assistant turn is dropped by the caller's renderer. A turn whose prompt is longer
    than `max_prompt_tokens` ends its conversation too: its sample could not fit the
    training length, so generating it would be wasted work.
    """
    from tqdm.auto import tqdm

    s = settings
    if s.backend not in ("hf", "server"):
        raise ValueError(f"unknown regeneration backend {s.backend!r} (hf or server)")
    if s.backend == "server" and s.server is None:
        raise ValueError("the server backend needs its ServerSettings")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    efforts = draw_efforts(s.reasoning_effort, len(conversations), s.seed)
    if "none" in efforts and is_harmony_tokenizer(tokenizer):
        raise ValueError(
            "data.regenerate.reasoning_effort: 'none' is not an effort of harmony (GPT-OSS) targets; "
            "use low, medium or high"
        )
    shaping = s.shaping()
    sources = [source_digest(c, {**shaping, "reasoning_effort": e}) for c, e in zip(conversations, efforts)]
    records = done_records(out_path)
    # a record whose source differs came from other data (another max_samples, dedupe,
    # max_turns) or other settings (another prompt cap, reply length, sampling, target):
    # generated again, and the later record wins on the next read
    done = {i: r for i, r in records.items() if i < len(conversations) and r["source"] == sources[i]}
    # records past this run's conversations stay for a larger one (the budget's probe writes some)
    stale = sum(1 for i in records if i < len(conversations) and i not in done)
    if stale:
        log.warning(
            "%s: %d records were generated from other conversations or settings than these; "
            "generating them again",
            out_path,
            stale,
        )
    todo = [i for i in (range(len(conversations)) if only is None else sorted(set(only))) if i not in done]
    # Batches are formed by the token length of the first prompt to generate from, so left
    # padding wastes little: sorting by characters of the first two messages let the
    # dataset's own reply decide, which left ~60% of prefill positions padding.
    # Conversations whose first prompt is already over the cap take no batch slot.
    first_prompt = {i: prompt_ids(tokenizer, before_first_reply(conversations[i]), efforts[i]) for i in todo}
    cap = s.max_prompt_tokens if s.max_prompt_tokens is not None else float("inf")
    too_long = [i for i in todo if len(first_prompt[i]) > cap]
    todo = sorted((i for i in todo if len(first_prompt[i]) <= cap), key=lambda i: len(first_prompt[i]))
    torch.manual_seed(s.seed)
    # The bar counts tokens, not conversations: the prompts run shortest first, so a
    # conversation count would promise the long tail at the short head's rate.
    work = {i: expected_tokens(conversations[i], len(first_prompt[i]), s.max_new_tokens) for i in todo}
    work.update((i, 0) for i in too_long)
    done_work = sum(expected_tokens(conversations[i], 0, s.max_new_tokens) for i in done)
    bar = tqdm(
        total=done_work + sum(work.values()),
        initial=done_work,
        desc="regenerate",
        unit="tok",
        unit_scale=True,
        disable=not s.progress,
    )
    with open(out_path, "a", encoding="utf-8") as f:
        writer = RecordWriter(f, sources, done)
        if too_long:  # ended before their first reply, as the loop below would end them
            for i in too_long:
                writer.write(i, [])
            writer.sync()
        if s.backend == "server":
            from eyas.data.regenerate_server import regenerate_with_server

            # the longest first: a long conversation started last would hold the run's tail
            todo.reverse()
            try:
                regenerate_with_server(
                    conversations, todo, tokenizer, s, writer.write_soon, bar, work, efforts
                )
            finally:
                writer.sync()
        else:
            _regenerate_hf(
                conversations,
                todo,
                first_prompt,
                tokenizer,
                model,
                writer,
                lambda b: bar.update(sum(work[i] for i in b)),
                s,
                efforts,
            )
    bar.close()
    if token_checks is not None:
        for r in done.values():
            token_checks.update(r["token_checks"])
    return [done[i]["messages"] if i in done else conversations[i] for i in range(len(conversations))]


def _hf_batches(todo: list[int], first_prompt: dict, s: RegenerationSettings) -> list[list[int]]:
    """`todo` (shortest first prompt first) cut into batches of `batch_size` conversations;
    with `batch_tokens`, batches sized by their padded prompt + reply slots instead, the
    longest first, so a run that cannot hold its longest prompts fails at the start."""
    if s.batch_tokens is None:
        return [todo[start : start + s.batch_size] for start in range(0, len(todo), s.batch_size)]
    slots = {i: len(first_prompt[i]) + s.max_new_tokens for i in todo}
    return pack_group(todo, slots, s.batch_tokens, s.batch_size)


def _regenerate_hf(
    conversations,
    todo,
    first_prompt,
    tokenizer,
    model,
    writer: RecordWriter,
    advance,
    s: RegenerationSettings,
    efforts,
) -> None:
    """The hf backend: batches of conversations, the next reply of every one decoded together."""
    max_prompt_tokens, states_dir = s.max_prompt_tokens, s.states_dir
    parse_calls = {i: calls_mode(tokenizer, conversations[i]) for i in todo}
    served = {i: as_served(tokenizer, conversations[i]) for i in todo}
    for batch in _hf_batches(todo, first_prompt, s):
        histories = {i: [] for i in batch}
        fed: dict[int, tuple[list[int], torch.Tensor]] = {}  # conversation -> its last kept reply's call
        pos = dict.fromkeys(batch, 0)  # each conversation's next recorded message
        diverged: set[int] = set()
        alive = set(batch)
        while alive:
            # The next reply of every live conversation in the batch: copy the recorded
            # messages before it (tool results only where the target made the same calls).
            need = []
            for i in [i for i in batch if i in alive]:
                pos[i], stop = copy_until_reply(served[i], pos[i], histories[i])
                if stop:
                    diverged.add(i)
                if stop or pos[i] >= len(served[i]):
                    alive.discard(i)
                else:
                    need.append(i)
                    pos[i] += 1
            if not need:
                continue
            # A conversation's first prompt was tokenised for sorting; later ones are built here.
            prompts = [
                first_prompt.pop(i, None) or prompt_ids(tokenizer, histories[i], efforts[i]) for i in need
            ]
            if max_prompt_tokens is not None:
                fits = [len(p) <= max_prompt_tokens for p in prompts]
                alive.difference_update(i for i, ok in zip(need, fits) if not ok)
                need = [i for i, ok in zip(need, fits) if ok]
                prompts = [p for p, ok in zip(prompts, fits) if ok]
                if not need:
                    continue
            decoded = decode_replies_hf(
                model,
                tokenizer,
                prompts,
                s.max_new_tokens,
                s.temperature,
                s.top_p,
                state_layer_ids=s.state_layer_ids if states_dir is not None else None,
            )
            replies = [
                decoded_reply(tokenizer, d.token_ids, d.finished, parse_calls.get(i), efforts[i])
                for i, d in zip(need, decoded)
            ]
            fed.update(
                (i, (d.fed_ids, d.states))
                for i, d, r in zip(need, decoded, replies)
                if not is_empty_reply(r) and d.states is not None
            )
            for i, reply in zip(need, replies):
                if not is_empty_reply(reply):
                    histories[i].append(reply)
                # a reply cut at max_new_tokens ends its conversation: the next turn would
                # answer text the target never finished
                if is_empty_reply(reply) or "finish_reason" in reply:
                    alive.discard(i)
        for i in batch:
            while histories[i] and histories[i][-1]["role"] != "assistant":
                histories[i].pop()
        if fed:  # before the records: a kill in between regenerates these, never records without states
            write_fed_states(
                states_dir,
                {i: fed[i] for i in batch if i in fed and histories[i]},
                s.state_layer_ids,
                s.target_name,
            )
        for i in batch:
            writer.write(i, histories[i], {"tool_divergence": 1} if i in diverged else None)
        writer.sync()
        advance(batch)
