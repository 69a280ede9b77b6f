"""What the time budget's probe measured on this machine (`Rates`) and the seconds per
stage a run of a given size is estimated at from them (DESIGN §2.7). The probe
(eyas/budget/probe.py) fills `Rates`; the sizing (eyas/budget/sizing.py) chooses from the
estimates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class BudgetError(ValueError):
    """A budget that cannot be parsed or a recipe it cannot size; the message says which."""


@dataclass
class Rates:
    """What the probe measured; counts refer to reading the recipe's `data.max_samples`."""

    # conversations read at the recipe's max_samples, counted as data.max_samples counts them:
    # before repeats are dropped
    conversations_read: int
    deduped: int  # of those, left once repeats are dropped
    regenerable: int  # of those, with a first prompt that fits
    # the probe's batch: where its conversations stand among those left (prepare keeps them)
    probe_positions: tuple[int, ...]
    regen_batch_s: float  # the probe's batch (0: no regeneration)
    samples_per_conversation: float  # rendered samples per regenerable conversation
    sample_tokens: float  # mean tokens of a rendered sample
    samples_per_step: float  # as the trainer packs them (batch_tokens, max_batch_size)
    step_s: float  # one first-epoch training step at that batch
    later_step_s: float  # one step of a later epoch (labels from the draft rows only)
    train_warmup_s: float  # what the first steps cost above that (the loss kernel's compile)
    capture_s_per_token: float  # a target forward with hidden states, per token
    # of the probe's samples, the share whose states the capture still computes (1 without
    # kept regeneration states; a reply that re-encodes to other tokens is run again)
    uncopied_share: float
    decode_s_per_token: float  # plain batch-1 decoding at the eval's dtype
    # speculative decoding with an untrained head (about a token per verify): the eval's
    # second pass at its slowest (the n-gram baseline replays the plain tokens)
    untrained_spec_s_per_token: float
    # the same head replayed over plain tokens: the eval's prompts beyond eval.decoded_prompts
    untrained_replay_s_per_token: float
    stage_start_s: float  # what every stage's process spends before its work (imports)
    read_s: float  # reading the conversations (prepare only)
    target_load_s: float  # loading the target (the stages that run it: prepare, capture, train, eval)


def estimate(rates: Rates, recipe, max_samples: int, epochs: float) -> dict[str, float]:
    """Seconds per stage when `max_samples` conversations are read and trained `epochs` times."""
    cfg, tr = recipe.data, recipe.train
    # reading fewer conversations drops their repeats in the same share (a prefix of the same file)
    scale = max_samples / rates.conversations_read
    regenerated = rates.regenerable * scale
    # prepare keeps the probe's replies among the conversations it reads, not the others'
    already = sum(p < rates.deduped * scale for p in rates.probe_positions)
    left_to_regenerate = max(0.0, regenerated - already)
    samples = regenerated * rates.samples_per_conversation
    tokens = samples * rates.sample_tokens
    prepare = (left_to_regenerate / max(1, len(rates.probe_positions))) * rates.regen_batch_s
    forward = tokens * rates.capture_s_per_token
    captured = forward * rates.uncopied_share  # the copies counted as free
    train_samples = samples * (1 - cfg.eval_fraction)
    if cfg.from_run:  # another run's prepared data and cache, as they are: train samples counted
        prepare, captured, train_samples = 0.0, 0.0, samples
    per_epoch = train_samples / max(rates.samples_per_step, 1e-9)
    steps = math.ceil(per_epoch * epochs / tr.grad_accum) * tr.grad_accum
    if tr.max_steps is not None:
        steps = min(steps, tr.max_steps * tr.grad_accum)
    first = min(steps, math.ceil(per_epoch))  # the first epoch's steps multiply the whole LM head
    # held-out passes: forward only, about a third of a training step each
    evals = (steps // max(1, tr.eval_every * tr.grad_accum)) * tr.eval_batches * rates.step_s / 3
    train = rates.train_warmup_s + first * rates.step_s + (steps - first) * rates.later_step_s + evals
    if cfg.features != "offline":  # the target (or engine) runs as the trainer reads, every epoch
        captured, train = 0.0, train + forward * epochs
    ev = recipe.eval
    turns = 2 if ev.workload == "mtbench" else 1
    prompts = ev.max_prompts or 80
    # plain decoding on every prompt; the head decoded on eval.decoded_prompts, replayed on the rest
    decoded = prompts if ev.temperature > 0 else min(prompts, ev.decoded_prompts or prompts)
    drafted = (
        decoded * rates.untrained_spec_s_per_token + (prompts - decoded) * rates.untrained_replay_s_per_token
    )
    evaluate = turns * ev.max_new_tokens * (prompts * rates.decode_s_per_token + drafted)
    start, load = rates.stage_start_s, rates.target_load_s
    # on another run's data prepare and capture only check it: nothing read, no target
    read, data_load = (0.0, 0.0) if cfg.from_run else (rates.read_s, load)
    return {
        "prepare": start + read + data_load + prepare,
        "capture": start + data_load + captured,
        "train": start + load + train,
        "export": start,
        "eval": start + load + evaluate,
    }
