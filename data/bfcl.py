"""The Berkeley Function Calling Leaderboard (the JSON shipped by the PyPI package
`bfcl-eval`, under `bfcl_eval/data/`) as tool conversations: a data source to tune a head
on tool-calling traffic, and a held-out workload to measure it.

Categories: simple (Python), multiple, parallel, parallel-multiple and multi-turn (base).
Each question's function docs become OpenAI `tools`; the reply is its first ground-truth
answer as `tool_calls` (regeneration replaces it with the target's own). A multi-turn
question's ground-truth calls are run, one after the other, on BFCL's own simulated
backends (file system, trading, travel, ...: the package's classes, loaded from its
initial config) so each call is followed by the result it really returns; calls are
parsed with `ast` and only literal arguments are passed, nothing is `eval`ed.

`bfcl:train` and `bfcl:test` split the questions by number within their category (every
fourth held out), so a head tuned on one is measured on questions it never saw; `bfcl`
is all. Rows alternate between categories, so `max_samples` takes a mix.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import logging
from itertools import zip_longest
from pathlib import Path

from eyas.core.assets import packaged_file

log = logging.getLogger(__name__)

BFCL_SPLITS = {"bfcl": None, "bfcl:train": "train", "bfcl:test": "test"}
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "multi_turn_base")
BFCL_VERSION_PREFIX = "BFCL_v4_"
HELD_OUT_EVERY = 4
# BFCL writes Python type names where JSON Schema (and the chat templates) want its own.
_SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def bfcl_dir() -> Path:
    return packaged_file("bfcl_eval", "data/README.md", "bfcl-eval").parent


def in_split(question_id: str, split: str | None) -> bool:
    """Whether a question (`simple_python_12`, `multi_turn_base_3`) is in the split."""
    if split is None:
        return True
    held_out = int(question_id.rsplit("_", 1)[-1]) % HELD_OUT_EVERY == 0
    return held_out if split == "test" else not held_out


def _schema(node):
    """A BFCL parameter schema with JSON Schema type names."""
    if isinstance(node, dict):
        out = {k: _schema(v) for k, v in node.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _SCHEMA_TYPES.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [_schema(v) for v in node]
    return node


def tool_name(name: str) -> str:
    """OpenAI function names allow no dots (`math.factorial` -> `math_factorial`)."""
    return name.replace(".", "_")


def as_tool(doc: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": tool_name(doc["name"]),
            "description": doc.get("description", ""),
            "parameters": _schema(doc.get("parameters", {"type": "object", "properties": {}})),
        },
    }


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _call(index: int, name: str, arguments: dict) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _answer_calls(ground_truth: list[dict]) -> list[dict]:
    """BFCL's possible answers (`[{func: {arg: [accepted values]}}]`) -> calls with each
    argument's first accepted value (an optional argument whose first option is "" is
    left out, as a caller would)."""
    calls = []
    for i, answer in enumerate(ground_truth):
        ((name, args),) = answer.items()
        chosen = {k: v[0] for k, v in args.items() if isinstance(v, list) and v and v[0] != ""}
        calls.append(_call(i, tool_name(name), chosen))
    return calls


def _questions(category: str, split: str | None) -> list[tuple[dict, list]]:
    """(question, its ground truth) of one category in the split."""
    root = bfcl_dir()
    answers = {
        a["id"]: a["ground_truth"]
        for a in _read_jsonl(root / "possible_answer" / f"{BFCL_VERSION_PREFIX}{category}.json")
    }
    return [
        (q, answers[q["id"]])
        for q in _read_jsonl(root / f"{BFCL_VERSION_PREFIX}{category}.json")
        if in_split(q["id"], split) and q["id"] in answers
    ]


def _single_turn_rows(category: str, split: str | None) -> list[dict]:
    rows = []
    for q, truth in _questions(category, split):
        messages = [dict(m) for turn in q["question"] for m in turn]
        messages.append({"role": "assistant", "content": "", "tool_calls": _answer_calls(truth)})
        rows.append(
            {
                "id": q["id"],
                "category": category,
                "tools": [as_tool(f) for f in q["function"]],
                "messages": messages,
            }
        )
    return rows


def _parse_call(text: str) -> tuple[str, list, dict]:
    """`mv(source='a', destination='b')` -> ("mv", [], {...}); literals only."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return node.func.id, args, kwargs


def _backends(entry: dict) -> dict:
    """Method name -> bound method of BFCL's simulated backends for one question."""
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES

    methods = {}
    for class_name in entry["involved_classes"]:
        instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)()
        if class_name not in STATELESS_CLASSES:
            instance._load_scenario(copy.deepcopy(entry.get("initial_config", {}).get(class_name, {})))
        methods.update(
            (n, m)
            for n, m in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not n.startswith("_")
        )
    return methods


def _run(methods: dict, text: str) -> tuple[str, dict, str]:
    """One ground-truth call -> (name, arguments by keyword, its result as text)."""
    name, args, kwargs = _parse_call(text)
    method = methods[name]
    bound = inspect.signature(method).bind(*args, **kwargs)
    try:
        result = method(*bound.args, **bound.kwargs)
    except Exception as err:  # the simulated backend's own error is what a caller would see
        result = f"Error during execution: {err}"
    if not isinstance(result, str):
        try:
            result = json.dumps(result, ensure_ascii=False)
        except TypeError:
            result = str(result)
    return name, dict(bound.arguments), result


def _multi_turn_rows(split: str | None) -> list[dict]:
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    root = bfcl_dir()
    category = "multi_turn_base"
    rows = []
    for q, truth in _questions(category, split):
        excluded = set(q.get("excluded_function") or [])
        docs = [
            d
            for c in q["involved_classes"]
            for d in _read_jsonl(root / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[c])
            if d["name"] not in excluded
        ]
        try:
            methods = _backends(q)
            messages, n = [], 0
            for turn, calls in zip(q["question"], truth):
                messages.extend(dict(m) for m in turn)
                for text in calls:
                    name, arguments, result = _run(methods, text)
                    messages.append(
                        {"role": "assistant", "content": "", "tool_calls": [_call(n, name, arguments)]}
                    )
                    messages.append(
                        {"role": "tool", "tool_call_id": f"call_{n}", "name": name, "content": result}
                    )
                    n += 1
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError) as err:
            log.warning("BFCL %s: its ground truth does not run here (%s); skipped", q["id"], err)
            continue
        rows.append(
            {"id": q["id"], "category": category, "tools": [as_tool(d) for d in docs], "messages": messages}
        )
    return rows


def bfcl_rows(source: str) -> list[dict]:
    """The questions of an alias as OpenAI rows (`id`, `category`, `tools`, `messages`),
    categories interleaved."""
    split = BFCL_SPLITS[source]
    per_category = [
        _multi_turn_rows(split) if c == "multi_turn_base" else _single_turn_rows(c, split)
        for c in BFCL_CATEGORIES
    ]
    return [row for group in zip_longest(*per_category) for row in group if row is not None]
