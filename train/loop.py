"""The training loop (DESIGN §2.4): accelerate-wrapped head, frozen target, bf16 autocast,
AdamW (or Muon for the hidden matrices, train/optimizers.py) with a cosine schedule and
warmup, gradient accumulation and clipping, periodic
evaluation, full-state checkpoints with automatic resume, and logging.

`accelerate launch -m eyas.train --recipe R` runs it on any number of processes; only the
head (inside `HeadWithLoss`) is handed to accelerate, the target stays frozen and
unwrapped on every rank. `train` reads as the recipe it runs: check the earlier run, set
up (train/run_setup.py), step, evaluate, checkpoint, save the head; the launcher plumbing
is in `train/distributed.py`.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from eyas.train.checkpoint import save_checkpoint
from eyas.train.distributed import (
    any_rank_nonfinite,
    any_rank_past,
    clip_gradients,
    make_accelerator,
    sum_counts_over_ranks,
    trained_head,
)
from eyas.train.feed import FeatureSource, batch_stream, to_device
from eyas.train.metrics import AccuracyMeter
from eyas.train.run_settings import EarlierRun, read_earlier_run
from eyas.train.run_setup import Run, setup

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. repeated non-finite losses); a checkpoint was saved."""


def train(
    recipe, target=None, progress: bool = True, restart: bool = False, accept_changes: bool = False
) -> dict:
    """Train the head a recipe describes; resumes from the newest checkpoint under
    `run_dir/checkpoints` (unless train.resume is false). Returns a summary dict with the
    final step, the final head directory and the last train/eval metrics
    (`already_finished`: the run had ended under these settings; nothing was done).

    A rerun under other settings than the checkpoints' is refused (`RerunRefused`, naming
    the keys) unless `accept_changes` (continue under the new ones) or `restart` (delete
    the run's checkpoints, head and metrics, and start anew); see train/run_settings.py.

    `target`: an already loaded `eyas.target.load.Target` (tests, notebooks); otherwise
    loaded from `recipe.target` on this process's device.
    """
    cfg = recipe.train
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    accelerator = make_accelerator(recipe, target)
    earlier = read_earlier_run(recipe, accelerator, restart, accept_changes)
    if earlier.finished and not earlier.changes:
        return _already_finished(recipe, accelerator, earlier)

    with ExitStack() as stack:  # the engine of data.features=engine, stopped on any exit
        run = setup(recipe, target, accelerator, earlier, progress, stack)
        try:
            _train_steps(run)
        finally:
            run.stream.close()
            run.bar.close()
            run.logger.close()
    return _summary(run)


def _train_steps(run) -> None:
    """Step, evaluate and checkpoint until the run's last step, or until
    `train.max_minutes` have passed; save the head."""
    cfg, accelerator, recipe = run.recipe.train, run.accelerator, run.recipe
    deadline = time.monotonic() + 60 * cfg.max_minutes if cfg.max_minutes else None
    while run.state.step < run.total:
        if deadline is not None and any_rank_past(accelerator, deadline):
            run.stopped_at_deadline = True
            if accelerator.is_main_process:
                log.warning(
                    "train.max_minutes (%g) reached: stopping at step %d of %d (a rerun resumes from here)",
                    cfg.max_minutes,
                    run.state.step,
                    run.total,
                )
            break
        skipped = train_step(run)
        run.state.step += 1
        run.bar.update(1)
        _count_skipped(run, skipped)
        if _due(run.state.step, cfg.log_every, run.total):
            _log_train(run)
        if run.eval_src is not None and _due(run.state.step, cfg.eval_every, run.total):
            run.last_eval = evaluate(accelerator, run.model, run.features, recipe, run.eval_src, run.pad_id)
            if run.last_eval:
                run.logger.log(run.last_eval, run.state.step)
        if cfg.save_every > 0 and run.state.step % cfg.save_every == 0 and run.state.step < run.total:
            checkpoint(run)
    if run.saved_at != run.state.step:
        checkpoint(run)
    save_final_head(run)
    # every rank done with its collectives before any destroys the process group; one
    # left to the interpreter's exit can abort a rank there (gloo's threads, see
    # train/__main__.py), failing a launch whose training succeeded
    accelerator.wait_for_everyone()
    accelerator.end_training()


# --- a run that had finished --------------------------------------------------------


def _already_finished(recipe, accelerator, earlier: EarlierRun) -> dict:
    saved = earlier.saved
    if accelerator.is_main_process:
        log.info("%s finished training at step %d; nothing to do", recipe.paths.root, saved.step)
    return {
        "is_main_process": accelerator.is_main_process,
        "step": saved.step,
        "total_steps": saved.total_steps,
        "final_dir": str(recipe.paths.checkpoints / "final"),
        "train": {},
        "eval": {},
        "nonfinite_steps": saved.nonfinite_total,
        "already_finished": True,
    }


# --- one optimizer step ----------------------------------------------------------------


def train_step(run: Run) -> bool:
    """One optimizer step over `train.grad_accum` micro-batches. Returns True when the
    update was skipped: a loss on any rank, or the gradient norm, was not finite."""
    cfg, accelerator = run.recipe.train, run.accelerator
    skipped = False
    for _ in range(cfg.grad_accum):
        batch, labels = run.features.complete(to_device(next(run.stream), accelerator.device))
        # the sampling of a micro-batch depends on its place in the epoch alone, so any
        # process count (and a resume) draws the same for the same global batch
        run.generator.manual_seed(micro_batch_seed(cfg.seed, *run.stream.last_index))
        with accelerator.accumulate(run.model):
            with accelerator.autocast():
                stats = run.model(batch, labels, run.generator)
            if any_rank_nonfinite(accelerator, stats.loss):
                skipped = True
                # every rank still runs a backward so gradient sync stays in step
                loss = sum(p.sum() for p in run.params) * 0.0
            else:
                loss = stats.loss
                run.meter.add(stats)
                run.window_tokens += stats.tokens
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                skipped = _apply_update(run, skipped)
    return skipped


def micro_batch_seed(seed: int, epoch: int, index: int) -> int:
    """The sampling seed of micro-batch `index` (over all ranks) of `epoch`."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63)


def _apply_update(run: Run, skipped: bool) -> bool:
    """Clip, step the optimizer unless the step is skipped, and advance the schedule either
    way (the schedule counts steps, not updates)."""
    cfg, accelerator = run.recipe.train, run.accelerator
    # DDP / FSDP2 / one process clip here; DeepSpeed clips inside its own step
    # (gradient_clipping, filled from the recipe) and reports its norm after it
    norm = clip_gradients(accelerator, run.model, run.params, cfg.max_grad_norm)
    if norm is not None:
        run.grad_norm = float(norm)
        if not torch.isfinite(norm):
            skipped = True
    if not skipped:
        run.optimizer.step()
        engine_norm = getattr(run.model, "get_global_grad_norm", None)
        if engine_norm is not None and (value := engine_norm()) is not None:
            run.grad_norm = float(value)
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return skipped


def _count_skipped(run: Run, skipped: bool) -> None:
    """Count a skipped step; too many in a row stop the run with a checkpoint."""
    state, cfg = run.state, run.recipe.train
    if not skipped:
        state.nonfinite_run = 0
        return
    state.nonfinite_total += 1
    state.nonfinite_run += 1
    run.logger.log({"train/nonfinite_steps": state.nonfinite_total}, state.step)
    log.warning(
        "step %d: non-finite loss or gradient, update skipped (%d in a row)", state.step, state.nonfinite_run
    )
    if state.nonfinite_run > cfg.max_nonfinite_steps:
        where = checkpoint(run)
        raise TrainingStopped(
            f"{state.nonfinite_run} steps in a row had a non-finite loss or gradient (limit "
            f"train.max_nonfinite_steps={cfg.max_nonfinite_steps}); stopped at step {state.step} "
            f"with a checkpoint at {where}. Lower train.learning_rate or check the data/features."
        )


def _due(step: int, every: int, total: int) -> bool:
    """Every `every` steps and at the last one; never when `every` is 0."""
    return every > 0 and (step % every == 0 or step == total)


def _log_train(run: Run) -> None:
    """Log the training metrics summed since the last log, and start a new window."""
    elapsed = time.perf_counter() - run.window_start
    if run.meter.batches:
        metrics = run.meter.summary("train/")
        metrics["train/tokens_per_s"] = run.window_tokens * run.accelerator.num_processes / max(elapsed, 1e-9)
        metrics["train/lr"] = run.scheduler.get_last_lr()[0]
        if run.grad_norm is not None:
            metrics["train/grad_norm"] = run.grad_norm
        run.logger.log(metrics, run.state.step)
        run.bar.set_postfix(
            loss=f"{metrics['train/loss']:.3f}",
            acc=f"{metrics.get('train/acc_0', 0):.3f}",
            tok_s=f"{metrics['train/tokens_per_s']:.0f}",
        )
        run.last_train = metrics
    run.meter.reset()
    run.window_start, run.window_tokens = time.perf_counter(), 0


# --- evaluation ------------------------------------------------------------------------


def evaluate(accelerator, model, features: FeatureSource, recipe, source, pad_id=0) -> dict:
    """Per-step accuracy, loss and simulated acceptance length on the held-out split,
    summed over ranks."""
    cfg = recipe.train
    world, rank = accelerator.num_processes, accelerator.process_index
    stream = batch_stream(recipe, source, rank, world, pad_id=pad_id, engine=features.engine, split="eval")
    stream.multiple_of = world
    try:
        n = stream.batches_per_epoch() // world
    except ValueError:
        return {}
    if cfg.eval_batches is not None:
        n = min(n, cfg.eval_batches)
    stream.limit(n)
    meter = AccuracyMeter()
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(n):
                batch, labels = features.complete(to_device(next(stream), accelerator.device), split="eval")
                with accelerator.autocast():
                    meter.add(model(batch, labels, None))
    finally:
        stream.close()
    model.train()
    sum_counts_over_ranks(accelerator, meter)
    return meter.summary("eval/") if meter.batches else {}


# --- saving ----------------------------------------------------------------------------


def checkpoint(run: Run) -> Path:
    """Write the full training state (every rank calls this) and return its directory."""
    state, stream = run.state, run.stream
    state.epoch, state.batches = stream.position.epoch, stream.position.batches
    state.scheduler = run.scheduler.state_dict()
    state.world_size = run.accelerator.num_processes
    where = save_checkpoint(
        run.recipe.paths.checkpoints,
        run.accelerator,
        run.model,
        run.optimizer,
        state,
        run.generator,
        run.recipe.train.keep_checkpoints,
    )
    run.saved_at = state.step
    return where


def save_final_head(run: Run) -> None:
    """The trained head as `checkpoints/final`, the directory export reads."""
    from eyas.heads.io import save_head

    head = trained_head(run.accelerator, run.model, run.head_cfg)
    if head is not None:
        save_head(head, run.recipe.paths.checkpoints / "final")
    run.accelerator.wait_for_everyone()


def _summary(run: Run) -> dict:
    return {
        "is_main_process": run.accelerator.is_main_process,
        "step": run.state.step,
        "total_steps": run.total,
        "final_dir": str(run.recipe.paths.checkpoints / "final"),
        "train": run.last_train,
        "eval": run.last_eval,
        "nonfinite_steps": run.state.nonfinite_total,
        "settings_changes": run.state.changes,
        "stopped_at_deadline": run.stopped_at_deadline,
    }
