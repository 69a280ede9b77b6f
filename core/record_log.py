"""Append-only JSON-lines logs that a killed run resumes from (regenerated replies, an
eval's decoded prompts): each whole line is one record, written and synced as the work
finishes, so a rerun keeps what is there and does the rest."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def read_records(path: Path) -> tuple[list[dict], int]:
    """(the whole records of `path`, the number of lines that are not a JSON object); none
    when the file is missing. A last line cut off by a kill is removed from the file, so
    appending continues on a fresh line."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    records, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict):
                records.append(rec)
            elif line.strip():
                bad += 1
    return records, bad


def append_record(path: Path, record: dict) -> None:
    """One record appended as one line of the log at `path`, flushed and fsynced: a kill
    after this returns keeps it. (Opened per record: for logs written every few seconds
    at most, not per token.)"""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def digest(value) -> str:
    """A short digest of a JSON-able value: what a record was made from, so a rerun with
    other inputs or settings never reuses it."""
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]
