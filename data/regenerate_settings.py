"""The settings of one regeneration job (DESIGN §2.1), the server backend's among them:
built once from the recipe's `data.regenerate` (data/prepare.py::regeneration_settings)
and passed whole to `regenerate` and both its backends, so a new setting is one field
here and one line in the builder."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServerSettings:
    """Where and how requests go; what they ask for (length, sampling, seed) is the
    RegenerationSettings' own, one set of fields for both backends."""

    urls: list[str]
    model: str | None = None
    concurrency: int = 256
    timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 0.5
    # starts the engine for the run (a context manager factory), or None: it is running
    engine: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class RegenerationSettings:
    backend: str = "hf"  # "hf" decodes in this process, "server" asks `server`'s engine
    batch_size: int = 16  # conversations decoded together (hf)
    batch_tokens: int | None = None  # and at most this many padded prompt + reply slots (hf)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # the sampling, and the draw of each conversation's reasoning effort
    # One effort or a mix {effort: weight} drawn per conversation (data/reasoning.py::draw_efforts).
    reasoning_effort: str | dict[str, float] | None = None
    # A turn whose prompt is longer ends its conversation: its sample could not fit max_length.
    max_prompt_tokens: int | None = None
    # The hf backend keeps the states of these layers for each conversation's last kept
    # reply under `states_dir` (data/fed_states.py), for the capture to copy.
    states_dir: str | Path | None = None
    state_layer_ids: Sequence[int] | None = None
    target_name: str = ""
    server: ServerSettings | None = None  # the server backend's engine and requests
    progress: bool = True

    def shaping(self) -> dict:
        """The settings that shape the replies, digested into each record's source so a
        changed recipe never reuses another recipe's replies."""
        return {
            "target": self.target_name,
            "backend": self.backend,
            "max_new_tokens": self.max_new_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "server_model": getattr(self.server, "model", None),
        }
