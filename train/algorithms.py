"""Training algorithms by name: each maps one batch to a `StepStats`.

A loss function has the signature `(head, batch, labels, train_cfg, generator) -> StepStats`
with `batch` the training batch of the brief (input_ids, attention_mask, loss_mask, aux,
last), `labels` the `TargetLabels` of that batch, `train_cfg` the recipe's TrainSection and
`generator` a torch.Generator for any sampling the algorithm does (checkpointed with the
run). P-EAGLE's loss lives in `eyas.train.cod` and is imported only when asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from eyas.train.copy_attention import copy_attention_loss, copy_attention_targets, recording_head0
from eyas.train.fastpath import ttt_loss_valid_rows
from eyas.train.step_stats import StepStats

LossFn = Callable[..., StepStats]


def eagle3_loss(head, batch: dict, labels, train_cfg, generator=None) -> StepStats:
    """EAGLE-3 training-time test: `train_cfg.ttt_steps` unrolled steps, weights decay^k
    (`ttt_loss`, evaluated on the valid slots only), plus `train_cfg.copy_attention_weight`
    times the copy supervision of attention head 0 over the first
    `train_cfg.copy_attention_steps` steps."""
    if train_cfg.copy_attention_weight <= 0:
        return ttt_loss_valid_rows(
            head, batch, labels, train_cfg.ttt_steps, train_cfg.ttt_decay, train_cfg.compile_loss
        )
    with recording_head0(head) as records:
        stats = ttt_loss_valid_rows(
            head, batch, labels, train_cfg.ttt_steps, train_cfg.ttt_decay, train_cfg.compile_loss
        )
    targets = copy_attention_targets(
        batch["input_ids"], labels.valid, batch["attention_mask"], steps=train_cfg.copy_attention_steps
    )
    copy = copy_attention_loss(records, targets, train_cfg.ttt_decay)
    stats.loss = stats.loss + train_cfg.copy_attention_weight * copy
    stats.extra_losses["copy_attention_loss"] = float(copy.detach())
    return stats


_LAZY = {"peagle": ("eyas.train.cod", "peagle_loss")}
_REGISTRY: dict[str, LossFn] = {"eagle3": eagle3_loss}


def register_algorithm(name: str, fn: LossFn) -> None:
    _REGISTRY[name] = fn


def loss_function(name: str) -> LossFn:
    """The loss function of algorithm `name` ("eagle3", "peagle", or a registered one)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _LAZY:
        module, attr = _LAZY[name]
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise NotImplementedError(
                f"algorithm {name!r} needs {module}.{attr}, which is not available: {err}"
            ) from err
        _REGISTRY[name] = fn
        return fn
    known = sorted(set(_REGISTRY) | set(_LAZY))
    raise ValueError(f"unknown training algorithm {name!r}; known: {', '.join(known)}")
