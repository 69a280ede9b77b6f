"""EAGLE-3 training (DESIGN §3): the training-time test loss, run on the valid rows
(train/fastpath.py), plus the optional copy supervision of attention head 0.

Every algorithm's loss has the signature `(head, batch, labels, train_cfg, generator) ->
StepStats` with `batch` the training batch (input_ids, attention_mask, loss_mask, aux,
last), `labels` the `TargetLabels` of that batch, `train_cfg` the recipe's TrainSection
(the algorithm's own knobs in `train_cfg.section(name)`) and `generator` a
torch.Generator for any sampling the algorithm does (checkpointed with the run). The
registration (heads/eagle3.py) names this module's `eagle3_loss`; P-EAGLE's is in
train/peagle.py.
"""

from __future__ import annotations

from eyas.train.copy_attention import (
    copy_attention_loss,
    copy_attention_targets,
    recording_head0,
)
from eyas.train.fastpath import ttt_loss_valid_rows
from eyas.train.step_stats import StepStats


def eagle3_loss(head, batch: dict, labels, train_cfg, generator=None) -> StepStats:
    """EAGLE-3 training-time test (`train.eagle3`): `ttt_steps` unrolled steps of the
    `train.loss` loss, weights decay^k (evaluated on the valid slots only), plus
    `copy_attention_weight` times the copy supervision of attention head 0 over the first
    `copy_attention_steps` steps."""
    cfg = train_cfg.section("eagle3")
    args = (head, batch, labels, cfg.ttt_steps, cfg.ttt_decay, train_cfg.compile_loss)
    args += (train_cfg.loss, train_cfg.lk_eta)
    if cfg.copy_attention_weight <= 0:
        return ttt_loss_valid_rows(*args)
    with recording_head0(head) as records:
        stats = ttt_loss_valid_rows(*args)
    segments = batch.get("segments")  # a packed batch: no copy source in another sample
    targets = copy_attention_targets(
        batch["input_ids"],
        labels.valid,
        batch["attention_mask"],
        steps=cfg.copy_attention_steps,
        segments=segments,
        window=head.config.sliding_window,
    )
    copy = copy_attention_loss(records, targets, cfg.ttt_decay, segments, head.config.sliding_window)
    stats.loss = stats.loss + cfg.copy_attention_weight * copy
    stats.extra_losses["copy_attention_loss"] = float(copy.detach())
    return stats
