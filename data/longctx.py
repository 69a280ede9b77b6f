"""Long-context prompts from long source files that every Python ships: modules of the
standard library, cut at a line boundary to a few lengths, with the request to continue
the file (DESIGN §8). Agent traffic runs 8k-100k tokens of context and a head's
acceptance falls as the context grows; this source reaches past 2k, 4k and 7k tokens on
the embedded SmolLM2 target (8,192 positions), where the short chat prompts never go.

`longctx:train` and `longctx:test` split the modules (every fourth held out), so a head
trained on one is measured on files it never saw; `longctx` is all of them. The reply
of a row is the file's next lines (regeneration replaces it with the target's own).
The text is the running Python's: another Python version gives other rows.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

LONGCTX_SPLITS = {"longctx": None, "longctx:train": "train", "longctx:test": "test"}
# Long pure-Python modules present from Python 3.10 on (a package's __init__ where a
# later version turned the module into one).
MODULES = (
    "argparse",
    "ast",
    "configparser",
    "dataclasses",
    "datetime",
    "difflib",
    "doctest",
    "enum",
    "functools",
    "inspect",
    "ipaddress",
    "locale",
    "mailbox",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "pydoc",
    "shutil",
    "ssl",
    "statistics",
    "subprocess",
    "tarfile",
    "threading",
    "traceback",
    "typing",
    "zipfile",
)
# Characters of the file in a prompt: about 1k, 3k, 5.5k and 7k tokens of Python for a
# 49k-vocabulary BPE (SmolLM2), so each context bucket gets prompts.
PROMPT_CHARS = (4_000, 10_000, 19_000, 24_000)
REPLY_CHARS = 2_000
HELD_OUT_EVERY = 4


def _module_text(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return None
    return Path(origin).read_text(encoding="utf-8")


def _cut(text: str, chars: int) -> str:
    """The text up to the last line break before `chars`."""
    end = text.rfind("\n", 0, chars)
    return text[: end + 1 if end > 0 else chars]


def longctx_rows(source: str) -> list[dict]:
    """The rows of an alias as conversation rows (`id`, `category`, `conversations`)."""
    split = LONGCTX_SPLITS[source]
    rows = []
    for i, name in enumerate(MODULES):
        held_out = i % HELD_OUT_EVERY == 0
        if split is not None and held_out != (split == "test"):
            continue
        text = _module_text(name)
        if text is None:
            continue
        for chars in PROMPT_CHARS:
            if len(text) < chars + REPLY_CHARS:
                continue
            shown = _cut(text, chars)
            ask = (
                f"Here is the start of the Python standard library module `{name}`:\n\n"
                f"```python\n{shown}```\n\nContinue the file from where it stops."
            )
            reply = text[len(shown) : len(shown) + REPLY_CHARS]
            rows.append(
                {
                    "id": f"{name}@{chars}",
                    "category": f"{chars // 1000}k chars",
                    "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": reply}],
                }
            )
    return rows
