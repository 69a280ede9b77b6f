"""A generated reply -> the assistant message eyas stores: `{"role": "assistant",
"content": final text, "reasoning": thinking text}` (reasoning only when there is some).

Targets write their reasoning in one of two shapes, and both regeneration backends (the
in-process decoder and a serving engine returning raw text) go through this one parser,
so a stored turn re-renders with the target's template to what the target produced:
- harmony (GPT-OSS): `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…`;
  the analysis channel is reasoning, the final channel the content. Text decoded with
  special tokens skipped cannot be split (`analysis…assistantfinal…`), which is why the
  decoder keeps them for harmony targets.
- think tags (Qwen3): `<think>…</think>` before the answer.
Anything else is plain content. Channels are never concatenated into `content`.
Tool calls (when the conversation offers tools): harmony's `to=functions.NAME` messages
here, the other families' shapes in data/tool_parse.py; they land in `tool_calls`.
"""

from __future__ import annotations

import json
import random
import re

from eyas.data.tool_parse import parse_tool_calls
from eyas.data.tools import normalize_calls

HARMONY_MARKERS = ("<|channel|>", "<|message|>")
_HARMONY_SPECIAL = re.compile(
    r"<\|(start|end|message|channel|return|call|constrain|endoftext|startoftext)\|>"
)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def is_harmony_tokenizer(tokenizer) -> bool:
    """Whether the tokenizer writes harmony: it has the `<|channel|>` and `<|message|>` tokens."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return all(m in vocab for m in HARMONY_MARKERS)


def parse_harmony(text: str, calls: list | None = None) -> tuple[str, str]:
    """Raw harmony completion text (after the `<|start|>assistant` generation prompt) ->
    (reasoning, content): analysis messages joined as reasoning, final (and commentary
    without a recipient) messages as content. Text outside any channel header is content,
    so a malformed completion loses nothing. With `calls` (a list), messages to
    `functions.NAME` whose body is a JSON object are appended to it as
    `{"name", "arguments"}` instead."""
    reasoning, content = [], []
    # Messages are `[<|start|>role]<|channel|>NAME<|message|>BODY` up to an end token.
    for part in re.split(r"<\|start\|>", text):
        if "<|message|>" not in part:
            stray = _HARMONY_SPECIAL.sub("", part).strip()
            if stray and stray != "assistant":
                content.append(stray)
            continue
        header, body = part.split("<|message|>", 1)
        body = re.split(r"<\|(?:end|return|call)\|>", body, maxsplit=1)[0]
        channel = header.split("<|channel|>", 1)[1].split()[0] if "<|channel|>" in header else "final"
        channel = re.sub(r"<\|[a-z]+\|>.*", "", channel)
        to = _RECIPIENT.search(header)
        if calls is not None and to:
            try:
                args = json.loads(body)
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                calls.append({"name": to.group(1), "arguments": args})
                continue
        (reasoning if channel == "analysis" else content).append(body)
    return "\n".join(r.strip() for r in reasoning if r.strip()), "\n".join(
        c.strip() for c in content if c.strip()
    )


def split_think(text: str) -> tuple[str, str]:
    """`<think>R</think> C` -> (R, C); text without a leading think block -> ("", text)."""
    m = _THINK.match(text)
    if not m:
        return "", text.strip()
    return m.group(1).strip(), text[m.end() :].strip()


def assistant_message(
    content: str,
    reasoning: str | None = None,
    raw: bool = True,
    finish_reason: str | None = None,
    tool_calls: list | None = None,
    parse_calls: str | None = None,
) -> dict:
    """The stored assistant message. `raw`: `content` may still hold harmony channels or a
    think block (a server or decoder without a reasoning parser), which are split off;
    a `reasoning` the server already parsed is kept as it is. Plain content is kept as the
    target wrote it, whitespace included: the sample must tokenize to the target's tokens.
    `finish_reason="length"` (the reply hit max_new_tokens) is stored on the message, so
    rendering ends the sample where the target stopped instead of at an end-of-turn token
    it never produced (data/templates.py).

    `tool_calls`: the calls a server's tool parser returned (OpenAI shape); else, with
    `parse_calls` ("tagged": `<tool_call>` blocks only, "json": also a bare JSON call) the
    raw text is parsed for them (data/tool_parse.py). A reply cut at max_new_tokens keeps
    its text as content: a cut call is not a call."""
    reasoning = (reasoning or "").strip()
    content = content or ""
    found: list = []
    if raw and all(m in content for m in HARMONY_MARKERS):
        r, content = parse_harmony(content, found if parse_calls and finish_reason != "length" else None)
        reasoning = "\n".join(x for x in (reasoning, r) if x)
    elif raw and "</think>" in content:
        r, content = split_think(content)
        reasoning = "\n".join(x for x in (reasoning, r) if x)
    if not tool_calls and not found and parse_calls and finish_reason != "length":
        content, found = parse_tool_calls(content, bare_json=parse_calls == "json")
    calls = normalize_calls(tool_calls) if tool_calls else normalize_calls(found) if found else None
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    if finish_reason == "length":
        msg["finish_reason"] = "length"
    return msg


def is_empty_reply(message: dict) -> bool:
    """No content to train on: the target stopped at once, or was cut inside its reasoning."""
    return not (message.get("content") or "").strip() and not message.get("tool_calls")


def decoded_reply(
    tokenizer,
    token_ids: list[int],
    finished: bool = True,
    parse_calls: str | None = None,
    effort: str | None = None,
) -> dict:
    """A reply decoded from the target's tokens (stop token excluded; `finished`: a stop
    token ended it, else max_new_tokens did): harmony targets keep their special tokens
    for the parser; others skip them. The ids are kept on the message (`token_ids`), so
    the sample trains them rather than its text tokenised again; `effort`: the reasoning
    effort it was prompted at, marked on the message."""
    reason = None if finished else "length"
    skip = not is_harmony_tokenizer(tokenizer)
    text = tokenizer.decode(token_ids, skip_special_tokens=skip)
    msg = assistant_message(text, finish_reason=reason, parse_calls=parse_calls)
    msg["token_ids"] = [int(t) for t in token_ids]
    return mark_effort(msg, effort)


def mark_effort(reply: dict, effort: str | None) -> dict:
    """`reply` marked with the reasoning effort it was prompted at (none: unchanged), the
    mark rendering reads back (`conversation_effort`)."""
    if effort is not None:
        reply["reasoning_effort"] = effort
    return reply


def effort_template_kwargs(effort: str | None) -> dict:
    """The chat-template arguments of a reasoning effort, as vLLM's chat endpoint derives
    them from its `reasoning_effort`: the effort itself (GPT-OSS writes `Reasoning: high`
    into its harmony system message) and `enable_thinking` off for `none` (Qwen3 opens
    the reply with an empty think block). None: the template's own default."""
    if effort is None:
        return {}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def conversation_effort(messages: list[dict]) -> str | None:
    """The effort a regenerated conversation was generated at: the `reasoning_effort`
    eyas marks on its assistant turns (None: not regenerated with one)."""
    return next((m["reasoning_effort"] for m in messages if m.get("reasoning_effort")), None)


def draw_efforts(setting: str | dict[str, float] | None, n: int, seed: int) -> list[str | None]:
    """The effort of each of `n` conversations: `setting` itself when it is one value, else
    drawn from the mix {effort: weight}, by a generator seeded with `seed` and the
    conversation's index, so a conversation's effort does not depend on which others
    are regenerated with it (a resumed run draws the same)."""
    if not isinstance(setting, dict):
        return [setting] * n
    names = sorted(setting)
    weights = [setting[k] for k in names]
    return [random.Random(f"{seed}:{i}").choices(names, weights)[0] for i in range(n)]
