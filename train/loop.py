"""The training loop (DESIGN §2.4): accelerate-wrapped head, frozen target, bf16 autocast,
AdamW with a cosine schedule and warmup, gradient accumulation and clipping, periodic
evaluation, full-state checkpoints with automatic resume, and logging.

`accelerate launch -m eyas.train --recipe R` runs it on any number of processes; only the
head (inside `HeadWithLoss`) is handed to accelerate, the target stays frozen and
unwrapped on every rank.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

from eyas.data.prepare import read_prepared_digest
from eyas.precision import resolve_mixed_precision, shapes_of_config
from eyas.train.algorithms import loss_function
from eyas.train.batching import DataPosition
from eyas.train.build import HeadWithLoss, frozen_output, initial_head
from eyas.train.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
    uses_engine_state,
)
from eyas.train.feed import FeatureSource, batch_stream, open_split, to_device
from eyas.train.metrics import AccuracyMeter, make_logger
from eyas.train.run_settings import RerunRefused, changed_settings, training_settings

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. repeated non-finite losses); a checkpoint was saved."""


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


def evaluate(accelerator, model, features: FeatureSource, recipe, source, pad_id=0) -> dict:
    """Per-step accuracy, loss and simulated acceptance length on the held-out split,
    summed over ranks."""
    cfg = recipe.train
    world, rank = accelerator.num_processes, accelerator.process_index
    stream = batch_stream(recipe, source, rank, world, pad_id=pad_id)
    stream.multiple_of = world
    try:
        n = stream.batches_per_epoch() // world
    except ValueError:
        return {}
    if cfg.eval_batches is not None:
        n = min(n, cfg.eval_batches)
    meter = AccuracyMeter()
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            batch, labels = features.complete(to_device(next(stream), accelerator.device), split="eval")
            with accelerator.autocast():
                meter.add(model(batch, labels, None))
    model.train()
    if world > 1 and meter.hits:
        counts = torch.tensor([meter.hits, meter.counts], dtype=torch.long, device=accelerator.device)
        counts = accelerator.reduce(counts, reduction="sum").tolist()
        meter.merge_counts(counts[0], counts[1])
    return meter.summary("eval/") if meter.batches else {}


def _fill_deepspeed_config(accelerator, cfg) -> None:
    """Resolve the DeepSpeed JSON's "auto" fields from the recipe: no dataloader goes
    through accelerate (batches are token-bucketed), so it cannot fill them itself."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = cfg.max_grad_norm
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = 1
    ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * cfg.grad_accum * accelerator.num_processes
    ds["gradient_accumulation_steps"] = cfg.grad_accum


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

    `target`: an already loaded `eyas.data.targets.Target` (tests, notebooks); otherwise
    loaded from `recipe.target` on this process's device.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from eyas.data.prepare import load_token_frequencies
    from eyas.data.targets import load_target
    from eyas.heads.io import save_head
    from eyas.heads.peagle import build_head
    from eyas.recipe import dump_recipe

    cfg = recipe.train
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    # Without a GPU, torchrun-launched processes (`accelerate launch --multi_gpu`) only form a
    # gloo process group when accelerate is told to use the CPU.
    # DeepSpeed picks its own device (DS_ACCELERATOR=cpu on a CPU machine).
    on_cpu = recipe.target.device == "cpu" or (
        recipe.target.device == "auto" and not torch.cuda.is_available()
    )
    on_cpu = on_cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true"
    if not on_cpu and not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        # DeepSpeed on CPU (DS_ACCELERATOR=cpu): accelerate finds no backend by itself and
        # would run every process as a world of one; gloo carries DeepSpeed's collectives.
        from accelerate import PartialState

        PartialState(backend="gloo")
    compute_device = "cuda" if torch.cuda.is_available() and not on_cpu else "cpu"
    accelerator = Accelerator(
        mixed_precision=_mixed_precision(recipe, target, compute_device),
        gradient_accumulation_steps=cfg.grad_accum,
        cpu=on_cpu,
    )
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    paths = recipe.paths
    ckpt_root = paths.checkpoints
    if accelerator.is_main_process:
        log.info(
            "training on %d process(es), %s, device %s, mixed precision %s",
            world,
            accelerator.distributed_type.name,
            device,
            accelerator.mixed_precision,
        )
    settings = training_settings(recipe, read_prepared_digest(paths.prepared))
    if restart and accelerator.is_main_process:
        clear_run(paths)
    accelerator.wait_for_everyone()
    # Decided before the target loads (minutes for a large one): a finished run is left as
    # it is, a changed one refused, before anything is written.
    latest = latest_checkpoint(ckpt_root)
    if latest is not None and not cfg.resume:
        raise RerunRefused(
            f"{ckpt_root} holds checkpoints of an earlier run and train.resume is false: pass "
            "--restart to delete them and start anew, or set run_dir to a new directory"
        )
    saved = read_trainer_state(latest) if latest is not None else None
    finished = (
        saved is not None
        and saved.total_steps > 0
        and saved.step >= saved.total_steps
        and (ckpt_root / "final").is_dir()
    )
    changes = changed_settings(saved.settings, settings) if saved is not None and saved.settings else []
    if saved is not None and not saved.settings:
        log.warning("%s predates recorded settings: resuming without checking the recipe against it", latest)
    if changes and not accept_changes:
        listed = "; ".join(changes)
        if finished:
            raise RerunRefused(
                f"{paths.root} finished training ({saved.step} steps) under other settings than "
                f"this recipe's ({listed}); nothing was changed. Pass --restart to train anew in "
                "this run dir (its checkpoints and head are deleted), or set run_dir to a new one"
            )
        raise RerunRefused(
            f"{latest} was trained under other settings than this recipe's ({listed}). Rerun with "
            "the recipe it was trained with, pass --accept-changes to continue from step "
            f"{saved.step} under the new ones, or --restart to train anew"
        )
    if finished and not changes:
        if accelerator.is_main_process:
            log.info("%s finished training at step %d; nothing to do", paths.root, saved.step)
        return {
            "is_main_process": accelerator.is_main_process,
            "step": saved.step,
            "total_steps": saved.total_steps,
            "final_dir": str(ckpt_root / "final"),
            "train": {},
            "eval": {},
            "nonfinite_steps": saved.nonfinite_total,
            "already_finished": True,
        }

    torch.manual_seed(cfg.seed)
    if target is None:
        t = recipe.target
        target = load_target(
            t.name_or_path,
            t.dtype,
            str(device),
            t.attn_implementation,
            t.trust_remote_code,
            t.revision,
            work_rows=cfg.batch_tokens,
        )
    target.model.to(device)
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    freqs_path = paths.prepared / "token_freqs.safetensors"
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
    features = FeatureSource(target.model, list(head_cfg.aux_layer_ids), frozen_output(target.model), head)

    train_src = open_split(recipe, head_cfg, "train")
    eval_src = open_split(recipe, head_cfg, "eval")
    stream = batch_stream(recipe, train_src, rank, world, pad_id=pad_id)
    steps_per_epoch = max(1, stream.batches_per_epoch() // (world * cfg.grad_accum))
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    model = HeadWithLoss(head, loss_function(head_cfg.algorithm), cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
    )
    # The scheduler is stepped by hand once per optimizer step (accelerate would step it
    # once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg.warmup_steps, total))
    _fill_deepspeed_config(accelerator, cfg)
    # The scheduler's state travels in state.json under every launcher: registered with
    # accelerate it would be pickled and loaded back with weights_only=False.
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + rank)

    state = TrainerState(world_size=world, total_steps=total, settings=settings)
    if latest is not None:
        if finished and total <= saved.step:
            raise RerunRefused(
                f"{paths.root} finished training at step {saved.step}; under the changed settings "
                f"it would train {total} steps in all, so nothing is left to train. Raise "
                "train.max_steps or train.epochs to train on, or pass --restart to train anew"
            )
        state = load_checkpoint(latest, accelerator, model, optimizer, generator)
        if changes:
            state.changes.append({"step": state.step, "changes": changes})
            if accelerator.is_main_process:
                log.warning(
                    "continuing %s from step %d under changed settings: %s",
                    paths.root,
                    state.step,
                    "; ".join(changes),
                )
        state.total_steps, state.settings = total, settings
        if state.world_size != world:
            log.warning(
                "%s was written by %d processes, resuming with %d: the data order changes",
                latest,
                state.world_size,
                world,
            )
        scheduler.load_state_dict(state.scheduler)
        stream.position = DataPosition(state.epoch, state.batches)
        if accelerator.is_main_process:
            log.info("resumed from %s (step %d)", latest, state.step)

    if accelerator.is_main_process:  # what this run is trained under, from now on
        paths.root.mkdir(parents=True, exist_ok=True)
        (paths.root / "recipe.yaml").write_text(dump_recipe(recipe))
    logger = (
        make_logger(cfg.logger, paths.root, recipe.name, recipe.model_dump(mode="json"))
        if accelerator.is_main_process
        else make_logger("none", paths.root)
    )

    def checkpoint() -> Path:
        state.epoch, state.batches = stream.position.epoch, stream.position.batches
        state.scheduler = scheduler.state_dict()
        state.world_size = world
        return save_checkpoint(
            ckpt_root, accelerator, model, optimizer, state, generator, cfg.keep_checkpoints
        )

    meter = AccuracyMeter()
    last_train, last_eval = {}, {}
    bar = tqdm(
        total=total,
        initial=state.step,
        desc="train",
        unit="step",
        disable=not (progress and accelerator.is_main_process),
    )
    t_window, tokens_window = time.perf_counter(), 0
    saved_at = state.step if latest is not None else -1
    model.train()
    try:
        while state.step < total:
            bad = False
            for _ in range(cfg.grad_accum):
                batch, labels = features.complete(to_device(next(stream), device))
                with accelerator.accumulate(model):
                    with accelerator.autocast():
                        stats = model(batch, labels, generator)
                    nonfinite = (~torch.isfinite(stats.loss.detach())).float()
                    if world > 1:
                        nonfinite = accelerator.reduce(nonfinite, reduction="sum")
                    if nonfinite.item() > 0:
                        bad = True
                        # every rank still runs a backward so gradient sync stays in step
                        loss = sum(p.sum() for p in params) * 0.0
                    else:
                        loss = stats.loss
                        meter.add(stats)
                        tokens_window += stats.tokens
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if cfg.max_grad_norm > 0 and not uses_engine_state(accelerator):
                            norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                            if norm is not None and not torch.isfinite(norm):
                                bad = True
                        if not bad:
                            optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
            state.step += 1
            bar.update(1)
            if bad:
                state.nonfinite_total += 1
                state.nonfinite_run += 1
                logger.log({"train/nonfinite_steps": state.nonfinite_total}, state.step)
                log.warning(
                    "step %d: non-finite loss or gradient, update skipped (%d in a row)",
                    state.step,
                    state.nonfinite_run,
                )
                if state.nonfinite_run > cfg.max_nonfinite_steps:
                    where = checkpoint()
                    raise TrainingStopped(
                        f"{state.nonfinite_run} steps in a row had a non-finite loss or gradient (limit "
                        f"train.max_nonfinite_steps={cfg.max_nonfinite_steps}); stopped at step {state.step} "
                        f"with a checkpoint at {where}. Lower train.learning_rate or check the data/features."
                    )
            else:
                state.nonfinite_run = 0
            if state.step % cfg.log_every == 0 or state.step == total:
                elapsed = time.perf_counter() - t_window
                if meter.batches:
                    last_train = meter.summary("train/")
                    last_train["train/tokens_per_s"] = tokens_window * world / max(elapsed, 1e-9)
                    last_train["train/lr"] = scheduler.get_last_lr()[0]
                    logger.log(last_train, state.step)
                    bar.set_postfix(
                        loss=f"{last_train['train/loss']:.3f}",
                        acc=f"{last_train.get('train/acc_0', 0):.3f}",
                        tok_s=f"{last_train['train/tokens_per_s']:.0f}",
                    )
                meter.reset()
                t_window, tokens_window = time.perf_counter(), 0
            if (
                eval_src is not None
                and cfg.eval_every > 0
                and (state.step % cfg.eval_every == 0 or state.step == total)
            ):
                last_eval = evaluate(accelerator, model, features, recipe, eval_src, pad_id)
                if last_eval:
                    logger.log(last_eval, state.step)
            if cfg.save_every > 0 and state.step % cfg.save_every == 0 and state.step < total:
                checkpoint()
                saved_at = state.step
        if saved_at != state.step:
            checkpoint()
        final_dir = ckpt_root / "final"
        if uses_engine_state(accelerator):
            full = accelerator.get_state_dict(model)
            if accelerator.is_main_process:
                fresh = build_head(head_cfg)
                fresh.load_state_dict(
                    {k[len("head.") :]: v for k, v in full.items() if k.startswith("head.")}, strict=False
                )
                save_head(fresh, final_dir)
        elif accelerator.is_main_process:
            save_head(accelerator.unwrap_model(model).head, final_dir)
        accelerator.wait_for_everyone()
    finally:
        bar.close()
        logger.close()
    return {
        "is_main_process": accelerator.is_main_process,
        "step": state.step,
        "total_steps": total,
        "final_dir": str(ckpt_root / "final"),
        "train": last_train,
        "eval": last_eval,
        "nonfinite_steps": state.nonfinite_total,
        "settings_changes": state.changes,
    }


def _mixed_precision(recipe, target, device: str) -> str:
    """`train.mixed_precision` for this device; `auto` is decided on the head's own
    multiplies (the target's widths, the draft vocabulary, a batch's tokens)."""
    from eyas.data.targets import load_target_config

    cfg, t = recipe.train, recipe.target
    shapes = None
    if cfg.mixed_precision == "auto" and device == "cpu":
        config = (
            target.config
            if target is not None
            else load_target_config(t.name_or_path, t.revision, t.trust_remote_code)
        )
        shapes = shapes_of_config(config, cfg.batch_tokens, recipe.head.draft_vocab_size)
    return resolve_mixed_precision(cfg.mixed_precision, device, shapes)


def clear_run(paths) -> None:
    """`--restart`: remove what an earlier run trained (checkpoints, the final head, its
    metrics and recipe); the prepared data and the cache stay."""
    import shutil

    shutil.rmtree(paths.checkpoints, ignore_errors=True)
    for name in ("metrics.jsonl", "recipe.yaml"):
        (paths.root / name).unlink(missing_ok=True)
    log.info("--restart: removed the checkpoints, head and metrics of the earlier run in %s", paths.root)
