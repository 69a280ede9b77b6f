"""Prompt-lookup (n-gram) drafting, the baseline a trained head has to beat.

Same rule as vLLM's n-gram proposer: find the longest n in [min_n, max_n] for which the
last n tokens occur earlier in the context (the earliest such occurrence), and propose
the (up to) k tokens that followed it. vLLM's defaults when neither bound is given are
prompt_lookup_min = prompt_lookup_max = 5.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

VLLM_DEFAULT_MIN = 5
VLLM_DEFAULT_MAX = 5


def ngram_propose(
    tokens: np.ndarray, k: int, min_n: int = VLLM_DEFAULT_MIN, max_n: int = VLLM_DEFAULT_MAX
) -> np.ndarray:
    """tokens [T] int -> up to k proposed ids (empty when no n-gram of the suffix recurs)."""
    total = tokens.shape[0]
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"n-gram bounds must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows of the context minus its last token: an occurrence must end before the
        # suffix itself does (overlap with it is allowed).
        windows = sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + k]
    return tokens[:0]


class NgramDrafter:
    """Drafter interface of `eyas.eval.speculate`: proposes from the token context only
    (no target features, deterministic, so its draft distribution is one-hot)."""

    name = "ngram"
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, min_n: int = VLLM_DEFAULT_MIN, max_n: int = VLLM_DEFAULT_MAX):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []

    def start(self, prompt: list[int], first_token: int, aux=None) -> None:
        self._tokens = list(prompt) + [first_token]

    def propose(self, k: int, temperature: float = 0.0, generator=None, truth=None):
        """-> (draft ids LongTensor [k' <= k], None: a one-hot draft distribution). `truth`
        (a replay's target tokens) changes nothing: prompt lookup reads only tokens."""
        ids = ngram_propose(np.asarray(self._tokens, dtype=np.int64), k, self.min_n, self.max_n)
        return torch.from_numpy(ids.copy()), None

    def commit(self, new_tokens: list[int], aux=None) -> None:
        self._tokens.extend(new_tokens)
