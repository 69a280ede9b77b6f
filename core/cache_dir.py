"""The one directory eyas keeps per-machine files in: the SmolLM2 target converted from its
GGUF, the timing verdicts of `dtype: auto` and of the decode attention, and the tests'
tokenizers built from published ranks."""

from __future__ import annotations

import os
from pathlib import Path


def eyas_cache_dir() -> Path:
    """$EYAS_CACHE_DIR, else $XDG_CACHE_HOME/eyas, else ~/.cache/eyas."""
    if os.environ.get("EYAS_CACHE_DIR"):
        return Path(os.environ["EYAS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eyas"
