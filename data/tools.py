"""Tool conversations: how eyas holds them, and how rows in the wild are read into it.

The in-memory shape (DESIGN §2.1) is OpenAI's, kept a plain list of messages:
- the tool definitions (OpenAI `tools`: `[{"type": "function", "function": {"name",
  "description", "parameters"}}]`) ride on the conversation's FIRST message under
  `"tools"`, so every prefix `conv[:k]` (a prompt, one sample per turn) keeps them;
  `conversation_tools(conv)` reads them and `without_tools(conv)` strips them before a
  template or a server sees the messages;
- an assistant turn that calls tools has `"tool_calls": [{"id", "type": "function",
  "function": {"name": str, "arguments": dict}}]` beside its `"content"` (a string, ""
  when the call has no text). Arguments are a dict, as chat templates read them; a server
  request gets them back as a JSON string (`openai_messages`);
- a tool result is `{"role": "tool", "content": str, "tool_call_id": str, "name": str}`
  (`name` filled from the call it answers when the row lacks it). Parallel calls are one
  assistant message with several `tool_calls`, followed by one `tool` message per call.

Every message keeps a string `content`, so code that reads roles and contents works on
tool conversations unchanged. ShareGPT-style tool rows (`function_call` / `observation`
turns and a `tools` column holding JSON, as LLaMA-Factory, Glaive and xLAM ship them)
are read into the same shape.
"""

from __future__ import annotations

import json
from typing import Any

Conversation = list[dict]


class ToolFormatError(ValueError):
    """A tool definition, call or result that cannot be read (a drop reason)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _json_value(value: Any) -> Any:
    """A JSON string decoded; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ToolFormatError("bad_tool_json") from None
    return value


def normalize_tools(tools: Any) -> list[dict] | None:
    """OpenAI `tools`, a bare list of function specs, or either as a JSON string ->
    `[{"type": "function", "function": spec}]`; None or empty -> None."""
    tools = _json_value(tools)
    if not tools:
        return None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise ToolFormatError("bad_tools")
    out = []
    for t in tools:
        spec = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ToolFormatError("bad_tools")
        out.append({"type": "function", "function": spec})
    return out


def normalize_call(call: Any, index: int) -> dict:
    """One OpenAI tool call (or a bare `{"name", "arguments"|"parameters"}`) -> the stored
    call, arguments as a dict and an id (`call_<index>` when the row has none)."""
    if not isinstance(call, dict):
        raise ToolFormatError("bad_tool_call")
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    args = _json_value(fn.get("arguments", fn.get("parameters", {}))) if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        raise ToolFormatError("bad_tool_call")
    call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{index}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def normalize_calls(calls: Any, first_index: int = 0) -> list[dict]:
    """A list of calls, one call, or either as JSON text -> stored calls."""
    calls = _json_value(calls)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise ToolFormatError("bad_tool_call")
    return [normalize_call(c, first_index + i) for i, c in enumerate(calls)]


def link_results(conv: Conversation) -> None:
    """Give each tool result the `tool_call_id` and `name` of the call it answers: by its
    id when it has one, else the calls of the last assistant turn in order. A result with
    no call before it raises `tool_result_without_call`."""
    pending: list[dict] = []
    by_id: dict[str, dict] = {}
    for m in conv:
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = list(m["tool_calls"])
            by_id.update((c["id"], c) for c in m["tool_calls"])
        elif m["role"] == "tool":
            call = by_id.get(m.get("tool_call_id")) if m.get("tool_call_id") else None
            if call is None:
                if not pending:
                    raise ToolFormatError("tool_result_without_call")
                call = pending[0]
            if call in pending:
                pending.remove(call)
            m["tool_call_id"] = call["id"]
            m.setdefault("name", call["function"]["name"])


def conversation_tools(conv: Conversation) -> list[dict] | None:
    """The tool definitions a conversation carries (on its first message), or None."""
    return conv[0].get("tools") if conv else None


def without_tools(conv: Conversation) -> Conversation:
    """The messages without the `tools` key their first message carries (copies)."""
    return [{k: v for k, v in m.items() if k != "tools"} for m in conv]


def with_tools(conv: Conversation, tools: list[dict] | None) -> Conversation:
    """The messages with `tools` put back on the first one (a no-op without tools)."""
    if not tools or not conv:
        return conv
    return [{**conv[0], "tools": tools}, *conv[1:]]


def has_tool_turns(conv: Conversation) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in conv)


def openai_messages(conv: Conversation) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as an OpenAI chat request wants them: call arguments as JSON text,
    eyas's own marks (`finish_reason`, `token_ids`) left out."""
    out = []
    for m in without_tools(conv):
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning"):
            msg["reasoning"] = m["reasoning"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
        for key in ("tool_call_id", "name"):
            if m["role"] == "tool" and key in m:
                msg[key] = m[key]
        out.append(msg)
    return out, conversation_tools(conv)


def same_calls(a: list[dict] | None, b: list[dict] | None) -> bool:
    """Whether two turns call the same functions with the same arguments (ids ignored;
    order ignored, as parallel calls have none)."""

    def key(calls):
        return sorted(
            (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
            for c in calls or []
        )

    return key(a) == key(b)


def _call_key(call: dict) -> tuple[str, str]:
    return call["function"]["name"], json.dumps(call["function"]["arguments"], sort_keys=True)


def copy_until_reply(conv: Conversation, pos: int, history: Conversation) -> tuple[int, bool]:
    """Regeneration's walk over a recorded conversation: copy the messages from `pos` into
    `history` (which ends with the target's own replies) up to the next recorded
    assistant turn -> (its index, or len(conv) at the end; whether to stop here).

    Recorded tool results are replayed only when the target's last reply made the same
    calls as the recorded turn they answer (same functions, same arguments; ids taken
    from the target's calls); otherwise, and when the target called tools but the record
    goes on without results, the conversation stops: a `tool_divergence` (results for
    calls the target did not make would teach the head a context it never sees)."""
    while pos < len(conv) and conv[pos]["role"] != "assistant":
        m = conv[pos]
        mine = history[-1] if history and history[-1]["role"] == "assistant" else None
        if m["role"] == "tool":
            recorded = next(c for c in reversed(conv[:pos]) if c["role"] == "assistant")
            if mine is None and history and history[-1]["role"] == "tool":
                mine = next(c for c in reversed(history) if c["role"] == "assistant")
            if mine is None or not same_calls(recorded.get("tool_calls"), mine.get("tool_calls")):
                return pos, True
            ids = {_call_key(c): c["id"] for c in mine["tool_calls"]}
            by_id = {c["id"]: _call_key(c) for c in recorded["tool_calls"]}
            key = by_id.get(m.get("tool_call_id"))
            history.append({**m, "tool_call_id": ids.get(key, m.get("tool_call_id"))})
        else:
            if mine is not None and mine.get("tool_calls"):
                return pos, True  # the target called tools; the record has no results for them
            history.append(dict(m))
        pos += 1
    if pos < len(conv) and history and history[-1]["role"] == "assistant" and history[-1].get("tool_calls"):
        return pos, True  # the record answers with text where the target awaits results
    return pos, False
