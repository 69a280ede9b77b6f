"""Telling a Hugging Face Hub repo id (`org/name`) from a local path, for the places where
a name is either: data sources, eval workloads, and the verifier a published head names."""

from __future__ import annotations

import re

_LOCAL_SUFFIX = re.compile(r"\.(jsonl?|parquet|csv|arrow|txt|gz|safetensors|bin)$", re.IGNORECASE)


def looks_like_hub_id(name: str) -> bool:
    """`org/name`: not a relative or absolute path, no file extension a local file would
    have. Anything else that does not exist locally is a missing file, not a Hub repo."""
    if not name or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return False
    return not _LOCAL_SUFFIX.search(name)
