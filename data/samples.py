"""The steps of prepare that shape conversations into samples, each a pure function of its
input (DESIGN §2.1): which turns a conversation trains on, repeated conversations and
samples, the held-out split by conversation, and the token frequencies of the trained
tokens. data/prepare.py runs them in order.
"""

from __future__ import annotations

import hashlib
import json
import random

import torch

from eyas.data.tool_text import as_served


def conversation_samples(tokenizer, conversation: list[dict], train_on: str) -> list[tuple[list[dict], str]]:
    """The (messages, render_with_mask's train_on) of each sample a conversation makes:
    itself, or with `turns` each prefix that ends at an assistant turn, its last turn
    trained after its serving prompt (render_with_mask's `turn`). The turns are those
    the target serves: where its template renders one call per turn, recorded parallel
    calls are call/result pairs first (data/tool_text.py)."""
    if train_on != "turns":
        return [(conversation, train_on)]
    served = as_served(tokenizer, conversation)
    return [(served[: k + 1], "turn") for k, m in enumerate(served) if m["role"] == "assistant"]


def drop_repeated_samples(
    ids: list[list[int]], masks: list[list[int]], kept: list[int]
) -> tuple[list[list[int]], list[list[int]], list[int], int]:
    """The samples without those equal, tokens and mask, to an earlier one -> (ids, masks,
    kept, number dropped). With `train_on: turns` two conversations that open alike (the
    same first question, the target's same reply) make the same first sample."""
    seen, out = set(), ([], [], [])
    for sample in zip(ids, masks, kept):
        key = hashlib.sha256(repr((sample[0], sample[1])).encode()).digest()
        if key in seen:
            continue
        seen.add(key)
        for column, value in zip(out, sample):
            column.append(value)
    return (*out, len(ids) - len(out[0]))


def split_by_conversation(kept: list[int], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """`split_indices` over conversations, not samples: every sample of a conversation goes
    to the split its conversation goes to, so no turn of a held-out conversation is trained
    on. With one sample per conversation it is `split_indices` over the samples."""
    groups = list(dict.fromkeys(kept))
    train_groups, _ = split_indices(len(groups), eval_fraction, seed)
    train = {groups[g] for g in train_groups}
    return (
        [i for i, c in enumerate(kept) if c in train],
        [i for i, c in enumerate(kept) if c not in train],
    )


def keep_first_turns(conversation: list[dict], max_turns: int) -> list[dict]:
    """The conversation up to and including its `max_turns`-th assistant turn."""
    out, seen = [], 0
    for message in conversation:
        if seen >= max_turns:
            break
        out.append(message)
        seen += message["role"] == "assistant"
    return out


def duplicate_indices(conversations: list[list[dict]], prompts_only: bool) -> list[int]:
    """The indices of the conversations repeating an earlier one. `prompts_only`: compare
    only the user and system turns (the replies will be regenerated); otherwise every
    message. Contents are compared after stripping surrounding whitespace."""
    seen, repeats = set(), []
    for i, conv in enumerate(conversations):
        key = tuple(
            (m["role"], m["content"].strip()) for m in conv if not (prompts_only and m["role"] == "assistant")
        ) + (json.dumps(conv[0].get("tools"), sort_keys=True),)  # the same question with other tools
        if key in seen:
            repeats.append(i)
            continue
        seen.add(key)
    return repeats


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic held-out split: a seeded shuffle; eval gets round(n * fraction) rows
    (at least one when the fraction is positive and n > 1)."""
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n > 1:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def token_frequencies(
    input_ids: list[list[int]], loss_masks: list[list[int]], vocab_size: int
) -> torch.Tensor:
    """Counts [Vt] int64 of each token id over the masked positions."""
    freqs = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in zip(input_ids, loss_masks):
        t = torch.tensor(ids, dtype=torch.int64)[torch.tensor(mask, dtype=torch.bool)]
        freqs += torch.bincount(t, minlength=vocab_size)[:vocab_size]
    return freqs
