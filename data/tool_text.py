"""Tool conversations for a given chat template: what the template renders itself, and
the JSON text eyas writes for what it cannot (DESIGN §2.1, tool conversations).

Whether a template renders tools is asked of the template itself, once: a probe
conversation with two tool definitions, one assistant turn with two calls and their
results is rendered, and the probe names are looked for in the text. Three outcomes:
- `native`: definitions and both calls render -> messages and `tools` go in as they are;
- `single`: only one call per assistant turn renders (GPT-OSS keeps `tool_calls[0]`,
  Llama 3.1 raises on two) -> parallel calls become consecutive call/result pairs, as such
  a target makes them when served (one call, its result, the next call);
- `text`: the template ignores tools (SmolLM2 and other plain ChatML templates) -> the
  Hermes-style JSON text those families document: the definitions as a JSON list inside
  `<tools></tools>` in the system message, the calls appended to the reply as
  `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`, and each run of results as
  one user turn of `<tool_response>` blocks. Nothing is dropped.
"""

from __future__ import annotations

import json

from eyas.data.tools import Conversation, conversation_tools, has_tool_turns, without_tools

_PROBE_TOOLS = [
    {"type": "function", "function": {"name": f"eyas_probe_def{i}", "description": "probe", "parameters": {}}}
    for i in (1, 2)
]
_PROBE = [
    {"role": "user", "content": "probe"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": f"eyas_probe_call{i}", "arguments": {}}}
            for i in (1, 2)
        ],
    },
    {"role": "tool", "content": "eyas_probe_result1", "tool_call_id": "c1", "name": "eyas_probe_call1"},
    {"role": "tool", "content": "eyas_probe_result2", "tool_call_id": "c2", "name": "eyas_probe_call2"},
]
_SUPPORT: dict[str, str] = {}

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are "
    "listed as JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    'To call functions, reply with <tool_call>[{{"name": <function-name>, "arguments": '
    "<args-json-object>}}]</tool_call>."
)


def tool_support(tokenizer) -> str:
    """`native`, `single` or `text` (see the module doc), probed once per template."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if template not in _SUPPORT:
        _SUPPORT[template] = _probe(tokenizer)
    return _SUPPORT[template]


def _try(tokenizer, messages, tools) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # jinja raises anything; a refusal is an answer
        return None


def _probe(tokenizer) -> str:
    text = _try(tokenizer, _PROBE, _PROBE_TOOLS)
    if text and all(f"eyas_probe_{w}" in text for w in ("def1", "def2", "call1", "call2", "result1")):
        return "native"
    single = [_PROBE[0], {**_PROBE[1], "tool_calls": _PROBE[1]["tool_calls"][:1]}, _PROBE[2]]
    text = _try(tokenizer, single, _PROBE_TOOLS)
    if text and all(f"eyas_probe_{w}" in text for w in ("def1", "call1", "result1")):
        return "single"
    return "text"


def split_parallel_calls(conv: Conversation) -> Conversation:
    """Each assistant turn with n calls -> n turns of one call, each followed by its result
    (the first keeps the turn's text and reasoning)."""
    out: Conversation = []
    i = 0
    while i < len(conv):
        m = conv[i]
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        results = []
        while j < len(conv) and conv[j]["role"] == "tool":
            results.append(conv[j])
            j += 1
        for n, call in enumerate(calls):
            head = (
                {k: v for k, v in m.items() if k != "tool_calls"}
                if n == 0
                else {"role": "assistant", "content": ""}
            )
            out.append({**head, "tool_calls": [call]})
            out.extend(r for r in results if r.get("tool_call_id") == call["id"])
        out.extend(r for r in results if r.get("tool_call_id") not in {c["id"] for c in calls})
        i = j
    return out


def call_text(calls: list[dict]) -> str:
    """The calls of one turn as the `text` form writes them."""
    payload = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    return f"<tool_call>{json.dumps(payload, ensure_ascii=False)}</tool_call>"


def as_text(conv: Conversation) -> Conversation:
    """The `text` form of a tool conversation: only system/user/assistant messages."""
    tools = conversation_tools(conv)
    out: Conversation = []
    for m in without_tools(conv):
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        elif m.get("tool_calls"):
            calls = m.pop("tool_calls")
            sep = "\n" if m["content"].strip() else ""
            out.append({**m, "content": m["content"].rstrip() + sep + call_text(calls)})
        else:
            out.append(m)
    for m in out:
        m.pop("_results", None)
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools=json.dumps([t["function"] for t in tools], ensure_ascii=False))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"].rstrip() + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def for_template(tokenizer, conv: Conversation) -> tuple[Conversation, list[dict] | None]:
    """(messages, tools) to hand the template for a conversation, per its tool support."""
    tools = conversation_tools(conv)
    if not tools and not has_tool_turns(conv):
        return without_tools(conv), None
    support = tool_support(tokenizer)
    if support == "text":
        return as_text(conv), None
    messages = without_tools(conv)
    if support == "single":
        messages = split_parallel_calls(messages)
    return messages, tools


def as_served(tokenizer, conv: Conversation) -> Conversation:
    """A recorded conversation as the target would live it, for regeneration: parallel
    calls become call/result pairs where the template renders one call per turn, so the
    target's single call can match the recorded one and its result be replayed."""
    if conversation_tools(conv) and tool_support(tokenizer) == "single":
        return split_parallel_calls(conv)
    return conv


def calls_mode(tokenizer, conv: Conversation) -> str | None:
    """How to read tool calls in this conversation's generated replies (data/reasoning.py
    `parse_calls`): None when it offers no tools, "tagged" for the text form, "json"
    where the template renders calls itself (a bare JSON call is one then)."""
    if not conversation_tools(conv):
        return None
    return "tagged" if tool_support(tokenizer) == "text" else "json"
