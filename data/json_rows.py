"""Streaming readers of JSON files of conversation rows: a top-level array read chunk by
chunk (a file cut off mid-record keeps every whole record; a malformed element is skipped
by its brackets) and JSON Lines. Each counts what it cannot read on the drop report it is
handed (data/conversations.py's `DropReport`) and names the row it is at (`report.row_at`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eyas.data.conversations import DropReport

# One JSON string (escapes included), one bracket, or a quote that opens a string the text
# does not close: enough to find where an element ends.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}"]')


def _element_end(buf: str, pos: int) -> int | None:
    """Where the JSON object or array starting at `pos` ends, by its brackets (strings
    skipped), whether or not its inside is valid JSON; None when it runs past `buf` (or
    into a string `buf` does not close)."""
    depth = 0
    for m in _JSON_TOKEN.finditer(buf, pos):
        tok = m.group()
        if tok == '"':
            return None
        if tok[0] == '"':
            continue
        depth += 1 if tok in "[{" else -1
        if depth == 0:
            return m.end()
    return None


def iter_json_array(path: Path, report: DropReport, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Stream the elements of a top-level JSON array without loading the whole file.

    A file cut off mid-record yields every whole record before the cut; the partial one
    is counted as `truncated_record`. A malformed element in the middle (an invalid value
    or escape inside balanced brackets) is skipped by its brackets, counted as
    `bad_record` and logged with its index, and reading goes on with the next element.
    An element whose brackets never close within 64 chunks stops the read as `bad_json`.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        buf, pos, eof, index = "", 0, False, 0

        def fill() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(chunk_chars)
            if not chunk:
                eof = True
                return False
            buf = buf[pos:] + chunk
            pos = 0
            return True

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or not fill():
                    return

        skip(" \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf):
                return  # EOF right after a whole record: cut between records
            if buf[pos] == "]":
                return
            obj, bad = None, False
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as err:
                    # An error at the buffer's end (or in a string it does not close) may
                    # only mean the record goes on in the next chunk; one inside it is a
                    # malformed record, skipped by its brackets once they are all read.
                    at_end = err.pos >= len(buf) - 8 or err.msg.startswith("Unterminated string")
                    end = (
                        None if at_end and not eof else (_element_end(buf, pos) if buf[pos] in "[{" else None)
                    )
                    if end is not None:
                        bad, why = True, f"not valid JSON ({err.msg})"
                        break
                    if not fill():
                        report.read += 1
                        report.drop(
                            "truncated_record", where=f"{path}[{index}]", why="the file ends inside it"
                        )
                        return
                    if len(buf) - pos > 64 * chunk_chars:
                        report.read += 1
                        report.drop("bad_json", where=f"{path}[{index}]", why="its brackets never close")
                        return
            report.row_at = f"{path}[{index}]"
            pos, index = end, index + 1
            if bad:
                report.read += 1
                report.drop("bad_record", where=report.row_at, why=why)
                continue
            yield obj


def iter_jsonl(path: Path, report: DropReport) -> Iterator[Any]:
    """One JSON value per line; a line that does not parse is counted as `bad_json`."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            report.row_at = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                report.read += 1
                report.drop("bad_json", where=report.row_at, why=f"not valid JSON ({err.msg})")
                continue
            yield row
