"""Tool calls in a generated reply's raw text -> the stored `tool_calls` (data/tools.py).

One parser for both regeneration backends (the in-process decoder, and a server that
returns raw text because it runs no tool parser), for the shapes the supported families
write:
- `<tool_call>` blocks: Qwen3-Coder's XML (`<function=NAME><parameter=P>V</parameter>`),
  Hermes / Qwen JSON (`{"name", "arguments"}`) and eyas's text form for templates without
  tool support (a JSON list of calls, data/tool_text.py);
- a reply that is one bare JSON object `{"name", "parameters"|"arguments"}` (Llama 3.1),
  only when the template renders calls itself (`bare_json`);
- harmony's `to=functions.NAME` commentary messages are split by data/reasoning.py.
A block that does not parse stays in the content: nothing the target wrote is lost.
"""

from __future__ import annotations

import json
import re

from eyas.data.tools import ToolFormatError, normalize_calls

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(text: str):
    """A parameter's text: JSON where it is JSON (numbers, objects, lists), else the text,
    which Qwen3-Coder's template writes back unchanged."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _block_calls(body: str) -> list[dict]:
    functions = _FUNCTION.findall(body)
    if functions:
        return [
            {"name": name, "arguments": {p: _xml_value(v) for p, v in _PARAMETER.findall(inner)}}
            for name, inner in functions
        ]
    value = json.loads(body.strip())
    return value if isinstance(value, list) else [value]


def parse_tool_calls(text: str, bare_json: bool = False) -> tuple[str, list[dict]]:
    """(content without the calls, the calls); ([], text) when it holds none."""
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        try:
            found = normalize_calls(_block_calls(m.group(1)), len(calls))
        except (json.JSONDecodeError, ToolFormatError):
            continue  # not a call: stays in the content
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls += found
    if calls:
        kept.append(text[pos:])
        return "".join(kept).strip(), calls
    if bare_json and text.strip().startswith("{"):
        try:
            value = json.loads(text)
            if (
                isinstance(value, dict)
                and "name" in value
                and ("parameters" in value or "arguments" in value)
            ):
                return "", normalize_calls([value])
        except (json.JSONDecodeError, ToolFormatError):
            pass
    return text, []
