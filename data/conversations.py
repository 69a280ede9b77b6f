"""Conversations in: ShareGPT (`conversations` of `from`/`value`), OpenAI (`messages`
of `role`/`content`), JSON arrays, JSONL, local dataset directories and `datasets` names.

Every reader yields normalised conversations: a list of `{"role": "system"|"user"|
"assistant"|"tool", "content": str}` dicts (an assistant turn may also carry `"reasoning"`,
the thinking/analysis text, which templates that know it render, and `"tool_calls"`; a
tool conversation's definitions ride on its first message: data/tools.py). Rows that cannot be
used are skipped and counted by reason in a `DropReport`, never raised, because real
corpora are dirty (the shipped ShareGPT file is even cut off mid-record). Files are read
with undecodable bytes kept apart (`surrogateescape`), so a row holding bytes that are not
UTF-8 is counted as `bad_encoding` and dropped (or, asked to, repaired with U+FFFD) instead
of being trained on as replacement characters nobody counted.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.core.hub_ids import looks_like_hub_id
from eyas.data.json_rows import iter_json_array, iter_jsonl
from eyas.data.sources import SOURCES, resolve_source
from eyas.data.tools import ToolFormatError, link_results, normalize_calls, normalize_tools

log = logging.getLogger(__name__)

Conversation = list[dict]

# ShareGPT speaker names seen in the wild -> chat-template roles.
_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    # tool results: OpenAI `tool`, ShareGPT-style `observation`, Llama's `ipython`
    "tool": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function": "tool",
}
# ShareGPT-style tool datasets write the assistant's call as its own turn, its JSON as the value.
_CALL_ROLES = {"function_call", "tool_call", "tool_calls"}


# What `surrogateescape` makes of a byte that is not UTF-8 (and what a JSON "\\udcXX" escape
# of a lone surrogate decodes to): never text a target was trained to read or write.
_UNDECODABLE = re.compile("[\udc80-\udcff]")
LOCATED_DROPS = 10  # per reason: the dropped rows named in the log and in drop_report.json


class NoUsableDataError(ValueError):
    """An input in which not a single conversation was usable."""


@dataclass
class DropReport:
    """How many rows were read, kept, and dropped per reason (JSON-serialisable)."""

    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    # Repairs that kept a row (e.g. leading assistant turns of split ShareGPT rows).
    repaired: Counter = field(default_factory=Counter)
    # Regenerated turns compared with the token ids the serving engine returned, and the
    # mismatches by reason (data/regenerate_server.py); kept, not dropped.
    token_checks: Counter = field(default_factory=Counter)
    # The first LOCATED_DROPS dropped rows per reason, as "file:line" (JSONL) or
    # "file[index]" (JSON array, dataset), so a user can open the row that was dropped.
    dropped_rows: dict[str, list[str]] = field(default_factory=dict)
    # Where the row a reader yielded last sits (set by the readers, read when it is dropped),
    # and where each kept conversation came from, in order (for drops after reading).
    row_at: str | None = None
    kept_rows: list[str | None] = field(default_factory=list)

    def drop(self, reason: str, n: int = 1, where: str | None = None, why: str = "") -> None:
        """Count `n` rows dropped for `reason`; a located row is named (log and report) while
        fewer than LOCATED_DROPS of that reason have been."""
        self.dropped[reason] += n
        if where is not None and len(self.dropped_rows.setdefault(reason, [])) < LOCATED_DROPS:
            self.dropped_rows[reason].append(where)
            log.warning("%s: dropped (%s)%s", where, reason, f": {why}" if why else "")

    def merge(self, other: DropReport) -> None:
        self.read += other.read
        self.kept += other.kept
        self.dropped.update(other.dropped)
        self.repaired.update(other.repaired)
        self.token_checks.update(other.token_checks)
        for reason, rows in other.dropped_rows.items():
            mine = self.dropped_rows.setdefault(reason, [])
            mine.extend(rows[: LOCATED_DROPS - len(mine)])

    def as_dict(self) -> dict:
        return {
            "read": self.read,
            "kept": self.kept,
            "dropped_total": sum(self.dropped.values()),
            "dropped": dict(sorted(self.dropped.items())),
            "repaired": dict(sorted(self.repaired.items())),
            **({"token_checks": dict(sorted(self.token_checks.items()))} if self.token_checks else {}),
            **({"dropped_rows": dict(sorted(self.dropped_rows.items()))} if self.dropped_rows else {}),
        }

    def summary(self) -> str:
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        return f"read {self.read}, kept {self.kept}, dropped {sum(self.dropped.values())} ({parts})"


def _is_row_list(value: Any) -> bool:
    """A list whose first element looks like a conversation row (ShareGPT or OpenAI)."""
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], dict)
        and any(isinstance(value[0].get(k), list) for k in ("conversations", "messages"))
    )


def iter_json_object(path: Path, report: DropReport) -> Iterator[Any]:
    """A file holding one JSON object (read whole): the rows of the list it wraps, as many
    exports write them (`{"data": [...]}`; with several such lists, `train`), or the object
    itself when it is one conversation. A file that does not parse as one value is read as
    JSONL (its first line is then a bad one); an object wrapping no rows is an error
    naming its keys."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            obj = json.load(f)
    except json.JSONDecodeError:
        yield from iter_jsonl(path, report)
        return
    if not isinstance(obj, dict):
        raise NoUsableDataError(f"{path}: a top-level {type(obj).__name__}, expected a list of conversations")
    keys = [k for k, v in obj.items() if _is_row_list(v)]
    if not keys:
        if normalize_row(obj)[1] != "unrecognized_format":  # one conversation, good or not
            report.row_at = str(path)
            yield obj
            return
        raise NoUsableDataError(
            f"{path}: a top-level object, expected a list of conversations "
            f"(keys: {', '.join(map(str, list(obj)[:20]))})"
        )
    key = "train" if "train" in keys else keys[0]
    if len(keys) > 1 and key != "train":
        raise NoUsableDataError(
            f"{path}: a top-level object with several lists of conversations (keys: {', '.join(keys)}); "
            "write the one to train on as a list of its own"
        )
    log.info("%s: a top-level object; reading the %d rows of its %r list", path, len(obj[key]), key)
    for i, row in enumerate(obj[key]):
        report.row_at = f"{path}:{key}[{i}]"
        yield row


def _holds_one_object(path: Path) -> bool:
    """Whether a file starting with `{` is one JSON object (its first line does not parse
    alone, or it is the only line) rather than JSONL."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = (x for x in f if x.strip())
        first, second = next(lines, ""), next(lines, None)
    try:
        json.loads(first)
    except json.JSONDecodeError:
        return True
    return second is None


def _text(content: Any) -> str | None:
    """The text of a turn: a string, or an OpenAI content list made only of text parts."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return "".join(p["text"] for p in content)
    return None


def normalize_row(
    row: Any, fmt: str = "auto", bad_encoding: str = "drop", repaired: Counter | None = None
) -> tuple[Conversation | None, str | None]:
    """One raw row -> (conversation, None) or (None, drop reason).

    Text holding bytes that were not UTF-8 drops the row as `bad_encoding`, or with
    `bad_encoding="replace"` has them replaced by U+FFFD (counted in `repaired` as
    `bad_encoding_replaced`, once per row).

    Leading assistant turns (ShareGPT splits long chats, so a part often starts mid-way
    with a `gpt` turn) have no prompt to condition on and are removed; the caller counts
    that repair when the returned conversation is shorter than the row."""
    if not isinstance(row, dict):
        return None, "not_an_object"
    if fmt in ("auto", "sharegpt") and isinstance(row.get("conversations"), list):
        turns, role_key, text_key = row["conversations"], "from", "value"
    elif fmt in ("auto", "openai") and isinstance(row.get("messages"), list):
        turns, role_key, text_key = row["messages"], "role", "content"
    else:
        return None, "unrecognized_format"
    try:
        conv, fixed = _messages(turns, role_key, text_key, bad_encoding)
        tools = normalize_tools(row.get("tools"))
        link_results(conv)
    except ToolFormatError as err:
        return None, err.reason
    # Trailing user/system/tool turns carry no loss and some templates reject them.
    while conv and conv[-1]["role"] != "assistant":
        conv.pop()
    if not conv:
        return None, "no_assistant_turn"
    system = [m for m in conv if m["role"] == "system"][:1]
    rest = [m for m in conv if m["role"] != "system"]
    # A leading assistant turn (and the results of its calls) has no prompt to condition on.
    while rest and rest[0]["role"] in ("assistant", "tool"):
        rest.pop(0)
    if not any(m["role"] == "assistant" for m in rest):
        return None, "no_assistant_turn"
    conv = system + rest
    if tools:
        conv[0]["tools"] = tools
    if fixed and repaired is not None:
        repaired["bad_encoding_replaced"] += 1
    return conv, None


def _messages(turns: list, role_key: str, text_key: str, bad_encoding: str) -> tuple[Conversation, bool]:
    """The turns of one row as messages -> (messages, whether bytes were replaced); a turn
    that cannot be used raises `ToolFormatError` with the row's drop reason."""
    conv: Conversation = []
    fixed = False
    for turn in turns:
        if not isinstance(turn, dict):
            raise ToolFormatError("not_an_object")
        name = str(turn.get(role_key, turn.get("role", ""))).lower()
        raw = turn.get(text_key, turn.get("content"))
        if name in _CALL_ROLES:
            # merged into the assistant turn before it when that turn has no calls yet
            calls = normalize_calls(raw, sum(len(m.get("tool_calls", [])) for m in conv))
            if conv and conv[-1]["role"] == "assistant" and not conv[-1].get("tool_calls"):
                conv[-1]["tool_calls"] = calls
            else:
                conv.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        role = _ROLE_MAP.get(name)
        if role is None:
            raise ToolFormatError("unknown_role")
        calls = turn.get("tool_calls") if role == "assistant" else None
        if calls:
            calls = normalize_calls(calls, sum(len(m.get("tool_calls", [])) for m in conv))
        if role == "tool" and isinstance(raw, (dict, list)) and _text(raw) is None:
            raw = json.dumps(raw, ensure_ascii=False)  # a structured result, shown as JSON
        text = "" if raw is None and (calls or role == "tool") else _text(raw)
        if text is None:
            raise ToolFormatError("non_text")
        reasoning = turn.get("reasoning_content", turn.get("reasoning", turn.get("thinking")))
        if _UNDECODABLE.search(text) or (isinstance(reasoning, str) and _UNDECODABLE.search(reasoning)):
            if bad_encoding != "replace":
                raise ToolFormatError("bad_encoding")
            fixed = True
            text = _UNDECODABLE.sub("\ufffd", text)
            reasoning = _UNDECODABLE.sub("\ufffd", reasoning) if isinstance(reasoning, str) else reasoning
        has_reasoning = role == "assistant" and isinstance(reasoning, str) and reasoning.strip()
        if not text.strip() and not has_reasoning and not calls and role != "tool":
            raise ToolFormatError("empty_turn")
        msg = {"role": role, "content": text}
        if has_reasoning:
            msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(turn.get(key), str) and turn[key]:
                    msg[key] = turn[key]
        conv.append(msg)
    return conv, fixed


def _turns_of(row: dict) -> list:
    return row.get("conversations") if isinstance(row.get("conversations"), list) else row.get("messages", [])


def iter_raw_rows(source: str, report: DropReport) -> Iterator[Any]:
    """Raw rows of one source: a named source (data/sources.py), a .json/.jsonl file, a
    dataset dir, or a `datasets` name."""
    rows, path = resolve_source(source)
    if rows is not None:
        yield from rows
        return
    if path.is_file():
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            yield from iter_json_array(path, report)
        elif head.startswith("{") and _holds_one_object(path):
            yield from iter_json_object(path, report)
        else:
            yield from iter_jsonl(path, report)
        return
    import datasets

    if not path.exists() and not looks_like_hub_id(source):
        raise NoUsableDataError(
            f"{source!r}: no such file or directory (a Hub dataset is named "
            f"org/name; the shipped aliases are {', '.join(map(repr, SOURCES))})"
        )
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
    else:
        try:
            ds = datasets.load_dataset(str(path) if path.is_dir() else source)
        except (ConnectionError, OSError) as err:
            # Offline or unreachable Hub: one line that says what to do, not a retry traceback.
            first = next((x.strip() for x in str(err).splitlines() if x.strip()), type(err).__name__)
            raise NoUsableDataError(
                f"data source {source!r}: cannot load it as a Hugging Face dataset ({first}). "
                f"Download it where the Hub is reachable, or point data.sources at a local "
                f".json/.jsonl file or dataset directory"
            ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    for i, row in enumerate(ds):
        report.row_at = f"{source}[{i}]"
        yield row


def read_conversations(
    sources: Iterable[str],
    fmt: str = "auto",
    max_samples: int | None = None,
    report: DropReport | None = None,
    bad_encoding: str = "drop",
) -> tuple[list[Conversation], DropReport]:
    """Read and normalise every source; raise `NoUsableDataError` when nothing is usable.
    `bad_encoding`: "drop" or "replace" rows with bytes that are not UTF-8 (see normalize_row)."""
    report = report or DropReport()
    out: list[Conversation] = []
    sources = list(sources)
    if not sources:
        raise NoUsableDataError("no data sources given (set data.sources, e.g. data.sources=[sharegpt])")
    for source in sources:
        report.row_at = None
        for row in iter_raw_rows(source, report):
            report.read += 1
            conv, reason = normalize_row(row, fmt, bad_encoding, report.repaired)
            if conv is None:
                report.drop(reason, where=report.row_at)
                continue
            if len(conv) < len(_turns_of(row)):
                report.repaired["leading_or_trailing_turns_removed"] += 1
            out.append(conv)
            report.kept += 1
            report.kept_rows.append(report.row_at)
            if max_samples is not None and len(out) >= max_samples:
                return out, report
    if not out:
        raise NoUsableDataError(f"no usable conversation in {sources}: {report.summary()}")
    return out, report
