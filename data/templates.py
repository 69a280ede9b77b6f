"""Render a conversation with the target's own chat template and mark the assistant
tokens (the loss mask), for any template, without per-family rules.

How the spans are found: for assistant turn k the template is rendered twice more,
  P = render(messages[:k], add_generation_prompt=True)   # ends right after the role header
  Q = render(messages[:k+1])                             # ends right after turn k
and the assistant span is the characters [len(P), len(Q)) of the full rendering, with
trailing whitespace removed: the target generates everything after the generation
prompt (reasoning / `<think>` blocks / harmony `analysis` channels included) up to and
including its end-of-turn token, while the newline many templates put between turns is
glue the target never emits. Templates that rewrite history (Qwen3 drops the thinking
of earlier turns) make Q differ from the full rendering; then the span ends at the first
special token after the turn's content (its end-of-turn token). The character span is mapped onto
tokens with the fast tokenizer's offsets: a token is trained when it starts inside it.

Tool conversations (data/tools.py) go to the template with its `tools` argument, adapted
to what the template renders (data/tool_text.py). An assistant turn that calls tools is a
span like any other (GPT-OSS's `to=functions.NAME` commentary message, Qwen3-Coder's
`<tool_call>` XML, Llama 3.1's JSON); tool results and definitions sit in user, tool or
system text and are never trained. Where a template rewrites a call turn when later turns
follow (GPT-OSS drops its analysis), the span ends at the first occurrence of the end
token the turn has when rendered last (`<|call|>`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from eyas.data.reasoning import conversation_effort, effort_template_kwargs
from eyas.data.tool_text import for_template

Conversation = list[dict]


class TemplateError(ValueError):
    """The template cannot be rendered incrementally for this conversation (a drop reason)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Rendered:
    """One rendered sample: `input_ids` [T] and `loss_mask` [T] (0/1), plus the text."""

    input_ids: list[int]
    loss_mask: list[int]
    text: str  # the whole rendering, also when the ids were truncated
    truncated: bool = False


# What eyas stores on a message for itself, never shown to a template.
EYAS_MARKS = ("finish_reason", "reasoning_effort", "token_ids")


def _render(
    tokenizer,
    messages: Conversation,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    kwargs: dict | None = None,
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(kwargs or {}),
        )
    except Exception as err:  # jinja raises anything (TemplateError, TypeError, raise_exception)
        raise TemplateError("template_error", str(err)[:200]) from None


def _template_messages(
    tokenizer, messages: Conversation
) -> tuple[Conversation, list[dict] | None, list[list[int] | None]]:
    """(messages, tools, the stored token ids of each message) for the template: tool
    turns adapted to what it renders (data/tool_text.py), eyas's own marks left out, and
    the reasoning under the names templates read (`reasoning_content` for Qwen3,
    `thinking` for GPT-OSS); templates that know neither ignore them."""
    messages, tools = for_template(tokenizer, messages)
    out, reply_ids = [], []
    for m in messages:
        m = dict(m)
        reply_ids.append(m.get("token_ids"))
        for mark in EYAS_MARKS:  # eyas's own (see render_with_mask), not the template's
            m.pop(mark, None)
        if "reasoning" in m:
            m.setdefault("reasoning_content", m["reasoning"])
            m.setdefault("thinking", m["reasoning"])
        out.append(m)
    return out, tools, reply_ids


TrainOn = Literal["all", "last", "turn"]


def assistant_char_spans(
    tokenizer, messages: Conversation, train_on: TrainOn = "all"
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character spans of the trained assistant turns.
    A conversation regenerated at a reasoning effort is rendered at it (the template
    arguments the target was prompted with)."""
    full, spans, _ = _turn_spans(tokenizer, messages, train_on)
    return full, spans


def _turn_spans(
    tokenizer, messages: Conversation, train_on: TrainOn
) -> tuple[str, list[tuple[int, int]], list[list[int] | None]]:
    """`assistant_char_spans` with the stored token ids of each span's turn. `turn`: the
    last turn, after the prompt the target is served for it, where the rendering of the
    whole differs before it (GPT-OSS drops the analysis of the calls of a tool chain
    once it is answered, but serves the answer after them)."""
    kwargs = effort_template_kwargs(conversation_effort(messages))
    messages, tools, stored_ids = _template_messages(tokenizer, messages)
    full = _render(tokenizer, messages, add_generation_prompt=False, tools=tools, kwargs=kwargs)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on in ("last", "turn"):
        turns = turns[-1:]
    spans = []
    for k in turns:
        prompt = _render(tokenizer, messages[:k], add_generation_prompt=True, tools=tools, kwargs=kwargs)
        start = (
            len(prompt) if full.startswith(prompt) else _start_by_tail(full, prompt, messages[k - 1], spans)
        )
        if start < 0:
            raise TemplateError("template_not_incremental", f"the prompt before turn {k} is not a prefix")
        upto = _render(tokenizer, messages[: k + 1], add_generation_prompt=False, tools=tools, kwargs=kwargs)
        if full.startswith(upto) and len(upto) > start:
            end = len(upto.rstrip())
        elif messages[k].get("tool_calls"):
            end = _end_like_last(tokenizer, full, start, upto)
        else:
            end = _end_by_special(tokenizer, full, start, messages[k])
        if end <= start:
            raise TemplateError("empty_assistant_span", f"turn {k}")
        if train_on == "turn" and start != len(prompt):
            full, start, end = prompt + full[start:], len(prompt), len(prompt) + end - start
        spans.append((start, end))
    return full, spans, [stored_ids[k] for k in turns]


def special_strings(tokenizer) -> list[str]:
    """The text of every special token (end-of-turn and role markers included)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            specials.add(tok.content)
    return [s for s in specials if s]


def _start_by_tail(full: str, prompt: str, before: dict, spans: list[tuple[int, int]]) -> int:
    """For templates that rewrite an earlier turn once later turns follow (GPT-OSS drops
    the analysis of a tool call answered later): the turn starts after the prompt's tail
    from the content of the message before it (a user turn or tool result), found in the
    full rendering after the last span; -1 when it is not there."""
    content = (before.get("content") or "").strip()
    at = prompt.rfind(content) if content else -1
    if at < 0:
        return -1
    tail = prompt[at:]
    found = full.find(tail, spans[-1][1] if spans else 0)
    return found + len(tail) if found >= 0 else -1


def _end_like_last(tokenizer, full: str, start: int, upto: str) -> int:
    """Where a call turn that the full rendering rewrites ends: at the first occurrence,
    after `start`, of the special token that ends it when it is rendered last."""
    tail = upto.rstrip()
    ends = [sp for sp in special_strings(tokenizer) if tail.endswith(sp)]
    if not ends:
        raise TemplateError("template_not_incremental", "a tool-call turn without an end token")
    end_token = max(ends, key=len)
    at = full.find(end_token, start)
    if at < 0:
        raise TemplateError(
            "template_not_incremental", "the tool-call turn's end token is not in the rendering"
        )
    return at + len(end_token)


def _end_by_special(tokenizer, full: str, start: int, message: dict) -> int:
    """For history-rewriting templates (Qwen3 and GPT-OSS drop the reasoning of earlier
    turns): the turn's content is located in the full text after `start`, and the turn
    ends with the first special token after it (the end-of-turn token)."""
    content = message["content"].strip()
    at = full.find(content, start) if content else start
    if at < 0:
        raise TemplateError("template_not_incremental", "assistant content not found in the rendering")
    after = at + len(content)
    hits = [(full.find(sp, after), sp) for sp in special_strings(tokenizer)]
    hits = [(i, sp) for i, sp in hits if i >= 0]
    if not hits:
        raise TemplateError("template_not_incremental", "no end-of-turn token after the content")
    i, sp = min(hits, key=lambda h: (h[0], -len(h[1])))
    return i + len(sp)


def render_with_mask(
    tokenizer,
    messages: Conversation,
    train_on: TrainOn = "all",
    max_length: int | None = None,
    truncate: bool = False,
) -> Rendered:
    """Tokenise the conversation as the chat template renders it, with the loss mask.

    `train_on`: `all` assistant turns, the `last`, or the last as a `turn` of its own: the
    text is then its serving prompt followed by the turn (data.train_on: turns).

    A last assistant message with `finish_reason: "length"` (a regenerated reply cut at
    max_new_tokens) ends the sample at its last content token: the end-of-turn special
    tokens the template writes after it, and all that follows, are not what the target
    produced, so they are neither trained on nor fed (DESIGN §2.1).

    A rendering longer than `max_length` raises `over_length`, or with `truncate` keeps its
    first `max_length` tokens (`Rendered.truncated` says so). Raises `TemplateError`
    (reason `over_length`, `no_masked_tokens`, `template_error`,
    `template_not_incremental`, ...) for a sample to drop.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("render_with_mask needs a fast tokenizer (for character offsets)")
    text, spans, stored_ids = _turn_spans(tokenizer, messages, train_on)
    ids, mask = _tokens_and_mask(tokenizer, text, spans, stored_ids)
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and last.get("finish_reason") == "length" and any(mask):
        end = _end_of_cut_reply(tokenizer, ids, mask)
        ids, mask = ids[:end], mask[:end]
    truncated = max_length is not None and len(ids) > max_length
    if truncated and not truncate:
        raise TemplateError("over_length", f"{len(ids)} > {max_length}")
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise TemplateError("no_masked_tokens")
    return Rendered(input_ids=list(ids), loss_mask=mask, text=text, truncated=truncated)


def _tokens_and_mask(
    tokenizer, text: str, spans: list[tuple[int, int]], stored_ids: list[list[int] | None]
) -> tuple[list[int], list[int]]:
    """The rendering's token ids and loss mask. The chat template already wrote BOS and
    specials, so the text is tokenised as it is, as apply_chat_template(tokenize=True)
    does; except that a reply stored with the `token_ids` the target generated is those
    ids (DESIGN §2.1, token-exact replies): its text can re-tokenise otherwise (a split
    the target sampled that the tokenizer would merge), and then the head would learn
    tokens the target never produced. The text around such a reply is tokenised apart,
    as the engine tokenised the prompt apart from what it generated."""
    specials = _special_ids(tokenizer) if any(stored_ids) else set()
    ids, mask, pos = [], [], 0
    for (start, end), token_ids in zip(spans, stored_ids):
        body_end = _reply_ids_fit(tokenizer, text, start, end, token_ids, specials)
        if body_end is None:
            continue
        _append_text(tokenizer, text, pos, start, spans, ids, mask)
        reply = _without_trailing(token_ids, specials)
        ids.extend(reply)
        mask.extend([1] * len(reply))
        pos = body_end
    _append_text(tokenizer, text, pos, len(text), spans, ids, mask)
    return ids, mask


def _append_text(tokenizer, text: str, a: int, b: int, spans, ids: list[int], mask: list[int]) -> None:
    """Tokenise text[a:b] onto `ids`, masked where its tokens start inside `spans`."""
    if b <= a:
        return
    enc = tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
    ids.extend(enc["input_ids"])
    mask.extend(_span_mask([(x + a, y + a) for x, y in enc["offset_mapping"]], spans))


def _special_ids(tokenizer) -> set[int]:
    return {i for i in tokenizer.convert_tokens_to_ids(special_strings(tokenizer)) if isinstance(i, int)}


def _without_trailing(token_ids: list[int], specials: set[int]) -> list[int]:
    """The ids without the special tokens that end them (the stop token an engine returns)."""
    end = len(token_ids)
    while end and token_ids[end - 1] in specials:
        end -= 1
    return list(token_ids[:end])


_SPACE = re.compile(r"\s+")


def _reply_ids_fit(
    tokenizer, text: str, start: int, end: int, token_ids: list[int] | None, specials: set[int]
) -> int | None:
    """Where the reply's own text ends in the span [start, end) (before the end-of-turn
    specials the template writes), when its stored `token_ids` decode to that text, or
    None: no ids, or a template that rewrote the turn (GPT-OSS drops the analysis of
    earlier turns), whose text the ids are not. Whitespace is not compared: templates
    trim content the target generated with it."""
    if not token_ids:
        return None
    body_end = end
    strings = sorted(special_strings(tokenizer), key=len, reverse=True)
    while True:
        stripped = text[start:body_end].rstrip()
        cut = next((s for s in strings if stripped.endswith(s)), None)
        if cut is None:
            break
        body_end = start + len(stripped) - len(cut)
    decoded = tokenizer.decode(_without_trailing(token_ids, specials), skip_special_tokens=False)
    if _SPACE.sub("", decoded) != _SPACE.sub("", text[start:body_end]):
        return None
    return body_end


def _end_of_cut_reply(tokenizer, ids: list[int], mask: list[int]) -> int:
    """Where a reply cut at max_new_tokens ends: after its last trained token that is not
    a special token (the template's end-of-turn tokens come after the content)."""
    specials = _special_ids(tokenizer)
    end = max(t for t, m in enumerate(mask) if m) + 1
    while end > 0 and mask[end - 1] and ids[end - 1] in specials:
        end -= 1
    return end


def _span_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters start inside one of the (sorted) spans."""
    mask = [0] * len(offsets)
    si = 0
    for t, (a, b) in enumerate(offsets):
        if b <= a:
            continue
        while si < len(spans) and a >= spans[si][1]:
            si += 1
        if si < len(spans) and spans[si][0] <= a < spans[si][1]:
            mask[t] = 1
    return mask


def prompt_ids(tokenizer, messages: Conversation, effort: str | None = None) -> list[int]:
    """Token ids of the conversation so far plus the assistant generation prompt, at the
    reasoning `effort` (None: the one marked on its assistant turns, if any)."""
    kwargs = effort_template_kwargs(effort or conversation_effort(messages))
    messages, tools, _ = _template_messages(tokenizer, messages)
    text = _render(tokenizer, messages, add_generation_prompt=True, tools=tools, kwargs=kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
