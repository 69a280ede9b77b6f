"""One training step of a recipe's draft head on synthetic features, at a target's shapes:
what `scripts/bench_head_step.py` times on a GPU node and what the quickstart's time budget
(eyas/budget/probe.py) times on this machine before it sizes a run. No target weights are
needed: the embeddings, LM head and features are random at a residual stream's scale, and
the step is the trainer's own (labels from the LM head, the recipe's loss under its
autocast, backward, clipping, its optimizer: train/optimizers.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

OUTSIDE_DRAFT_SCALE = 0.8


def synthetic_batch(
    b: int, t: int, vocab: int, aux_width: int, hidden: int, device, gen, lengths: list[int] | None = None
) -> dict:
    """Right-padded [B, T] sequences, the last 60% of each real stretch in the loss mask;
    aux [B, T, n·Ht] and last [B, T, Ht] in bf16 at a residual stream's scale. The real
    stretches have `lengths` (B of them, the longest T) when given, else random lengths in
    [T/2, T]: a loss whose work follows the real tokens (P-EAGLE's COD elements) is timed
    at a real batch's tokens only with the former."""
    if lengths is None:
        lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
        lengths[0] = t
    else:
        if len(lengths) != b or max(lengths) != t:
            raise ValueError(f"lengths {lengths} do not describe a [{b}, {t}] batch")
        lengths = torch.tensor(lengths)
    slots = torch.arange(t)[None]
    am = (slots < lengths[:, None]).long()
    loss = am * (slots >= (lengths[:, None] * 2) // 5).long()
    return {
        "input_ids": torch.randint(0, vocab, (b, t), generator=gen).to(device),
        "attention_mask": am.to(device),
        "loss_mask": loss.to(device),
        "aux": (torch.randn(b, t, aux_width, generator=gen) * 4).to(device, torch.bfloat16),
        "last": (torch.randn(b, t, hidden, generator=gen) * 4).to(device, torch.bfloat16),
    }


@dataclass
class HeadStep:
    """A built head and its step. `run(batch, later_epoch=False)` trains on one batch and
    returns its loss tokens; with `later_epoch` the labels multiply only the draft rows of
    the LM head, as the trainer does from its second epoch on (the batch must have been run
    once before)."""

    run: Callable[..., int]
    head_config: object
    head_params: int
    target_dtype: torch.dtype
    mixed_precision: str
    aux_width: int


def build_head_step(recipe, target_config, verifier: str, device, rows: int) -> HeadStep:
    """The recipe's head over `target_config`'s dimensions and its training step on `device`;
    `rows`: the tokens a step holds, which the bf16-or-float32 choice is timed at."""
    from eyas.core.precision import resolve_dtype, resolve_mixed_precision, shapes_of_config
    from eyas.heads.algorithms import get_algorithm
    from eyas.heads.layers import RMSNorm
    from eyas.train.build import head_config_for, head_from_target_weights
    from eyas.train.fastpath import draft_first_lm_head, label_mask, valid_row_labels
    from eyas.train.optimizers import build_optimizer

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    freqs = torch.randint(1, 1000, (target_config.vocab_size,), generator=gen)
    head_cfg = head_config_for(recipe, target_config, verifier=verifier, token_freqs=freqs)
    ht, vt = target_config.hidden_size, target_config.vocab_size
    embed = torch.randn(vt, ht, generator=gen) * 0.02
    lm_head = torch.randn(vt, ht, generator=gen) * 0.02
    head = head_from_target_weights(head_cfg, freqs, embed, lm_head, torch.ones(ht)).to(device)
    # Rows outside the draft vocabulary scaled down, so that most positions' top token lies
    # inside it, as with a draft vocabulary built from the data: the loss then runs on most
    # rows (and at the size where its kernel is compiled), not on a random sixth of them.
    outside = torch.ones(vt, dtype=torch.bool)
    outside[head.draft_token_ids().cpu()] = False
    lm_head[outside] *= OUTSIDE_DRAFT_SCALE
    # the frozen target's output the labels come from, in the target's dtype
    shapes = shapes_of_config(target_config, rows)
    target_dtype = getattr(torch, resolve_dtype(recipe.target.dtype, device, shapes))
    norm = RMSNorm(ht, target_config.rms_norm_eps).to(device, target_dtype)
    target_lm = draft_first_lm_head(lm_head.to(device, target_dtype), head.draft_token_ids())
    del embed, lm_head
    cfg = recipe.train
    loss_fn = get_algorithm(head_cfg.algorithm).loss_function()
    params = [p for p in head.parameters() if p.requires_grad]
    step_gen = torch.Generator(device=device).manual_seed(0)
    head_shapes = shapes_of_config(target_config, rows, vocab=head_cfg.draft_vocab_size)
    mixed_precision = resolve_mixed_precision(cfg.mixed_precision, device, head_shapes)
    opt = build_optimizer(head.named_parameters(), cfg, mixed_precision)

    known: dict[int, torch.Tensor] = {}  # id(batch) -> the valid slots its first-epoch step found

    def run(batch: dict, later_epoch: bool = False) -> int:
        with torch.no_grad():
            labels = valid_row_labels(
                batch["last"],
                norm,
                target_lm,
                label_mask(batch, cfg.label_prompts),  # the slots the trainer labels
                batch["attention_mask"],
                known_valid=known.get(id(batch)) if later_epoch else None,
                segments=batch.get("segments"),
            )
        known.setdefault(id(batch), labels.valid)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
            stats = loss_fn(head, batch, labels, cfg, step_gen)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(stats.tokens)

    return HeadStep(
        run,
        head_cfg,
        sum(p.numel() for p in head.parameters()),
        target_dtype,
        mixed_precision,
        len(head_cfg.aux_layer_ids) * ht,
    )


@dataclass
class StepTimes:
    """Seconds of the timed steps of a first epoch and of a later one, and of the untimed
    first steps (compiles, allocator warm-up) that a training run pays once."""

    first_epoch: list
    later_epoch: list
    warmup: list


def packed_row(batch: dict, lengths: list[int]) -> dict:
    """A `synthetic_batch` of rows of `lengths` as one packed row (`train.packing`)."""
    from eyas.train.batching import collate_packed

    keys = ("input_ids", "loss_mask", "aux", "last")
    samples = [{k: batch[k][r, :n].cpu() for k in keys} for r, n in enumerate(lengths)]
    device = batch["input_ids"].device
    return {k: v.to(device) for k, v in collate_packed(samples).items()}


def time_head_steps(
    step: HeadStep,
    target_config,
    lengths: list[int],
    device,
    steps: int = 3,
    warmup: int = 2,
    packed: bool = False,
) -> StepTimes:
    """Times `warmup` untimed steps, then `steps` first-epoch and `steps` later-epoch steps,
    on synthetic batches of sequences of `lengths` (a real batch's; with `packed`, one
    packed row of them)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    batches = [
        synthetic_batch(
            len(lengths),
            max(lengths),
            target_config.vocab_size,
            step.aux_width,
            target_config.hidden_size,
            device,
            gen,
            lengths=lengths,
        )
        for _ in range(2)
    ]
    if packed:
        batches = [packed_row(b, lengths) for b in batches]

    def timed(i: int, later: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step.run(batches[i % 2], later_epoch=later)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    warm = [timed(i, False) for i in range(max(warmup, 2))]  # both batches seen: later epochs can run
    return StepTimes(
        first_epoch=[timed(i, False) for i in range(steps)],
        later_epoch=[timed(i, True) for i in range(steps)],
        warmup=warm,
    )
