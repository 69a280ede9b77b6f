"""A training run's setup (DESIGN §2.4): the target, the head, the data, the optimizer and
its schedule, the checkpoint to resume from, the logger and the progress bar, gathered in
one `Run` that train/loop.py steps until the end.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.heads.algorithms import get_algorithm
from eyas.train.batching import DataPosition
from eyas.train.build import HeadWithLoss, frozen_output, initial_head
from eyas.train.checkpoint import TrainerState, load_checkpoint
from eyas.train.distributed import fsdp_requested, prepare, shard_head, whole_target_loading
from eyas.train.feed import FeatureSource, batch_stream, open_split
from eyas.train.metrics import AccuracyMeter, make_logger
from eyas.train.optimizers import build_optimizer, refuse_muon_when_sharded
from eyas.train.run_settings import EarlierRun, RerunRefused

log = logging.getLogger(__name__)


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
    stopped_at_deadline: bool = False  # train.max_minutes ended the run before its last step


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
        target.model,
        list(head_cfg.aux_layer_ids),
        frozen_output(target.model),
        head,
        engine,
        label_prompts=cfg.label_prompts,
    )
    stream = batch_stream(recipe, train_src, rank, world, pad_id=pad_id, engine=engine)
    steps_per_epoch = max(1, stream.batches_per_epoch() // (world * cfg.grad_accum))
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))

    model = shard_head(
        accelerator, HeadWithLoss(head, get_algorithm(head_cfg.algorithm).loss_function(), cfg)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model.named_parameters(), cfg, accelerator.mixed_precision)
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
