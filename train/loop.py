"""The training loop (DESIGN §2.4): accelerate-wrapped head, frozen target, bf16 autocast,
AdamW (or Muon for the hidden matrices, train/optimizers.py) with a cosine schedule and
warmup, gradient accumulation and clipping, periodic
evaluation, full-state checkpoints with automatic resume, and logging.

`accelerate launch -m eyas.train --recipe R` runs it on any number of processes; only the
head (inside `HeadWithLoss`) is handed to accelerate, the target stays frozen and
unwrapped on every rank. `train` reads as the recipe it runs: check the earlier run, set
up, step, evaluate, checkpoint, save the head; the launcher plumbing is in
`train/distributed.py`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.heads.algorithms import get_algorithm
from eyas.train.batching import DataPosition
from eyas.train.build import HeadWithLoss, frozen_output, initial_head
from eyas.train.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from eyas.train.distributed import (
    any_rank_nonfinite,
    clip_gradients,
    fsdp_requested,
    make_accelerator,
    prepare,
    shard_head,
    sum_counts_over_ranks,
    trained_head,
    whole_target_loading,
)
from eyas.train.feed import FeatureSource, batch_stream, open_split, to_device
from eyas.train.metrics import AccuracyMeter, make_logger
from eyas.train.optimizers import build_optimizer, refuse_muon_when_sharded
from eyas.train.run_settings import EarlierRun, RerunRefused, read_earlier_run

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
    """Step, evaluate and checkpoint until the run's last step; save the head."""
    cfg, accelerator, recipe = run.recipe.train, run.accelerator, run.recipe
    while run.state.step < run.total:
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


# --- setup -----------------------------------------------------------------------------


@dataclass
class Run:
    """What a training run carries from one optimizer step to the next."""

    recipe: Any
    accelerator: Any
    head_cfg: Any
    model: Any  # the prepared HeadWithLoss
    optimizer: Any
    scheduler: Any
    params: list  # the trainable parameters, clipped and zeroed together
    features: FeatureSource
    stream: Any  # the training BatchStream of this rank
    eval_src: Any
    pad_id: int
    generator: torch.Generator  # the algorithm's sampling (COD), reseeded per micro-batch
    state: TrainerState
    total: int  # optimizer steps of the whole run
    saved_at: int = -1  # step of the newest checkpoint written or resumed from
    logger: Any = None
    bar: Any = None
    meter: AccuracyMeter = field(default_factory=AccuracyMeter)
    last_train: dict = field(default_factory=dict)
    last_eval: dict = field(default_factory=dict)
    grad_norm: float | None = None  # before clipping, at the last update (None: not measured)
    window_start: float = 0.0  # the throughput window since the last train log
    window_tokens: int = 0


def setup(recipe, target, accelerator, earlier: EarlierRun, progress: bool, stack: ExitStack) -> Run:
    """Target, head, data, optimizer and schedule, then the checkpoint to resume from. The
    order is the run's random state (the seed, then the head's initial weights), so a rerun
    trains bit for bit the same. With data.features=engine the engine is started (or found)
    here and entered into `stack`, which stops it."""
    cfg = recipe.train
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    # before the target loads (minutes for a large one)
    sharded_by = "FSDP2" if fsdp_requested() and world > 1 else None
    refuse_muon_when_sharded(
        cfg, "DeepSpeed" if accelerator.distributed_type.name == "DEEPSPEED" else sharded_by
    )
    torch.manual_seed(cfg.seed)
    if target is None:
        with whole_target_loading():
            target = _load_target(recipe, device)
    target.model.to(device)
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    head, head_cfg = _build_head(recipe, target, device)
    train_src = open_split(recipe, head_cfg, "train")
    eval_src = open_split(recipe, head_cfg, "eval")
    engine = _engine(recipe, head_cfg, target, accelerator, stack)  # once the data is there
    features = FeatureSource(
        target.model, list(head_cfg.aux_layer_ids), frozen_output(target.model), head, engine
    )
    stream = batch_stream(recipe, train_src, rank, world, pad_id=pad_id, engine=engine)
    steps_per_epoch = max(1, stream.batches_per_epoch() // (world * cfg.grad_accum))
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    model = shard_head(
        accelerator, HeadWithLoss(head, get_algorithm(head_cfg.algorithm).loss_function(), cfg)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model.named_parameters(), cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg.warmup_steps, total))
    model, optimizer = prepare(accelerator, model, optimizer, cfg)
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + rank)
    state = TrainerState(world_size=world, total_steps=total, settings=earlier.settings)
    run = Run(
        recipe=recipe,
        accelerator=accelerator,
        head_cfg=head_cfg,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        params=params,
        features=features,
        stream=stream,
        eval_src=eval_src,
        pad_id=pad_id,
        generator=generator,
        state=state,
        total=total,
    )
    if earlier.latest is not None:
        _resume(run, earlier)
    stream.limit((total - run.state.step) * cfg.grad_accum)
    if not run.state.logger_run_id:
        run.state.logger_run_id = uuid.uuid4().hex[:12]
    run.logger = _open_logger(recipe, accelerator, run.saved_at if earlier.latest else None, run.state)
    run.bar = _progress_bar(run, progress)
    run.window_start = time.perf_counter()
    model.train()
    return run


def _engine(recipe, head_cfg, target, accelerator, stack):
    """data.features=engine: the client of the engine that computes the states, else None."""
    if recipe.data.features != "engine":
        return None
    from eyas.train.engine_feed import training_engine

    say = log.info if accelerator.is_main_process else log.debug
    world = accelerator.num_processes
    ids = list(head_cfg.aux_layer_ids)
    return stack.enter_context(training_engine(recipe, ids, target.num_layers, world, say))


def _load_target(recipe, device):
    """The target on this rank: whole for online features; its embeddings, final norm and
    LM head alone where a cache or an engine hands over the states (no copy of its layers)."""
    from eyas.target.load import load_recipe_target

    layers = recipe.data.features == "online"
    return load_recipe_target(
        recipe.target, work_rows=recipe.train.batch_tokens, device=str(device), decoder_layers=layers
    )


def _build_head(recipe, target, device):
    """The initial head (fresh or train.init_from) on `device`, and its config."""
    from eyas.data.prepare import load_token_frequencies

    cfg = recipe.train
    freqs_path = recipe.paths.prepared / "token_freqs.safetensors"
    freqs = load_token_frequencies(freqs_path) if freqs_path.is_file() else None
    # the verifier the exported head names: the recipe's Hub id for a target loaded from a local dir
    head, head_cfg = initial_head(recipe, target, freqs, verifier=recipe.target.hub_id or target.hub_id)
    head = head.to(device)
    if cfg.freeze_lm_head:
        if head_cfg.hidden_size != head_cfg.target_hidden_size:
            raise ValueError(
                "train.freeze_lm_head needs head.hidden_size equal to the target's "
                f"({head_cfg.target_hidden_size}): only then is the LM head copied from the target"
            )
        # keeps the target's own output rows: far fewer weights to fit on a small dataset
        head.lm_head.weight.requires_grad_(False)
    return head, head_cfg


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
    """LR multiplier of optimizer step s: linear warmup over `warmup_steps`, then a cosine
    decay to `min_ratio` at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _resume(run: Run, earlier: EarlierRun) -> None:
    """Load the newest checkpoint into the prepared objects and move the data stream there;
    the run continues under this recipe's settings and length."""
    accelerator, saved, latest = run.accelerator, earlier.saved, earlier.latest
    root = run.recipe.paths.root
    if earlier.finished and run.total <= saved.step:
        raise RerunRefused(
            f"{root} finished training at step {saved.step}; under the changed settings "
            f"it would train {run.total} steps in all, so nothing is left to train. Raise "
            "train.max_steps or train.epochs to train on, or pass --restart to train anew"
        )
    state = load_checkpoint(latest, accelerator, run.model, run.optimizer, run.generator)
    if earlier.changes:
        state.changes.append({"step": state.step, "changes": earlier.changes})
        if accelerator.is_main_process:
            log.warning(
                "continuing %s from step %d under changed settings: %s",
                root,
                state.step,
                "; ".join(earlier.changes),
            )
    state.total_steps, state.settings = run.total, earlier.settings
    if state.world_size != accelerator.num_processes:
        log.warning(
            "%s was written by %d processes, resuming with %d: the data order changes",
            latest,
            state.world_size,
            accelerator.num_processes,
        )
    run.scheduler.load_state_dict(state.scheduler)
    run.stream.position = DataPosition(state.epoch, state.batches)
    run.state, run.saved_at = state, state.step
    if accelerator.is_main_process:
        log.info("resumed from %s (step %d)", latest, state.step)


def _open_logger(recipe, accelerator, resume_step, state: TrainerState):
    """The metrics logger (rank 0 only), after writing the recipe this run trains under
    from now on; a resumed run continues its logs from the checkpoint's step."""
    paths = recipe.paths
    if not accelerator.is_main_process:
        return make_logger("none", paths.root)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.recipe.write_text(recipe.to_yaml())
    return make_logger(
        recipe.train.logger,
        paths.root,
        recipe.name,
        recipe.model_dump(mode="json"),
        resume_step=resume_step,
        run_id=state.logger_run_id,
    )


def _progress_bar(run: Run, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=run.total,
        initial=run.state.step,
        desc="train",
        unit="step",
        disable=not (progress and run.accelerator.is_main_process),
    )


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
    }
