"""The accelerate / DeepSpeed plumbing of the training loop (DESIGN §2.4): which device,
process group and mixed precision a run gets, the DeepSpeed JSON's "auto" fields, the
collectives the loop needs, and reading the trained head back out of a sharded engine.

`train/loop.py` calls these and stays a plain recipe; nothing here decides what is trained.
"""

from __future__ import annotations

import logging
import os

import torch

from eyas.core.precision import resolve_mixed_precision, shapes_of_config
from eyas.train.checkpoint import uses_engine_state

log = logging.getLogger(__name__)


def runs_on_cpu(recipe) -> bool:
    """Whether accelerate is told to use the CPU. DeepSpeed picks its own device
    (DS_ACCELERATOR=cpu on a CPU machine), so it is never told."""
    device = recipe.target.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return on_cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true"


def make_accelerator(recipe, target=None):
    """The run's `Accelerator`: gradient accumulation from the recipe, the mixed precision
    for its device, and a process group that works without a GPU."""
    from accelerate import Accelerator

    # Without a GPU, torchrun-launched processes (`accelerate launch --multi_gpu`) only form a
    # gloo process group when accelerate is told to use the CPU.
    on_cpu = runs_on_cpu(recipe)
    if not on_cpu and not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        # DeepSpeed on CPU (DS_ACCELERATOR=cpu): accelerate finds no backend by itself and
        # would run every process as a world of one; gloo carries DeepSpeed's collectives.
        from accelerate import PartialState

        PartialState(backend="gloo")
    compute_device = "cuda" if torch.cuda.is_available() and not on_cpu else "cpu"
    accelerator = Accelerator(
        mixed_precision=mixed_precision_for(recipe, target, compute_device),
        gradient_accumulation_steps=recipe.train.grad_accum,
        cpu=on_cpu,
    )
    if accelerator.is_main_process:
        log.info(
            "training on %d process(es), %s, device %s, mixed precision %s",
            accelerator.num_processes,
            accelerator.distributed_type.name,
            accelerator.device,
            accelerator.mixed_precision,
        )
    return accelerator


def mixed_precision_for(recipe, target, device: str) -> str:
    """`train.mixed_precision` for this device; `auto` is decided on the head's own
    multiplies (the target's widths, the draft vocabulary, a batch's tokens)."""
    from eyas.target.load import load_target_config

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


def fill_deepspeed_config(accelerator, cfg) -> None:
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


def prepare(accelerator, model, optimizer, cfg):
    """Wrap the head-with-loss and its optimizer for the launcher (DDP, DeepSpeed, FSDP).
    The scheduler is not handed over: registered with accelerate it would be stepped once
    per process and pickled into checkpoints (loaded back with weights_only=False), so the
    loop steps it and its state travels in state.json."""
    fill_deepspeed_config(accelerator, cfg)
    return accelerator.prepare(model, optimizer)


def any_rank_nonfinite(accelerator, loss: torch.Tensor) -> bool:
    """Whether the loss is non-finite on any rank, so every rank skips the same update."""
    nonfinite = (~torch.isfinite(loss.detach())).float()
    if accelerator.num_processes > 1:
        nonfinite = accelerator.reduce(nonfinite, reduction="sum")
    return nonfinite.item() > 0


def sum_counts_over_ranks(accelerator, meter) -> None:
    """Replace an `AccuracyMeter`'s hits and counts by their sums over ranks."""
    if accelerator.num_processes > 1 and meter.hits:
        counts = torch.tensor([meter.hits, meter.counts], dtype=torch.long, device=accelerator.device)
        counts = accelerator.reduce(counts, reduction="sum").tolist()
        meter.merge_counts(counts[0], counts[1])


def trained_head(accelerator, model, head_cfg):
    """The trained head on the main process, None on the others (every rank calls this:
    under DeepSpeed / FSDP gathering the sharded weights is a collective)."""
    from eyas.heads.algorithms import build_head

    if uses_engine_state(accelerator):
        full = accelerator.get_state_dict(model)
        if not accelerator.is_main_process:
            return None
        fresh = build_head(head_cfg)
        fresh.load_state_dict(
            {k[len("head.") :]: v for k, v in full.items() if k.startswith("head.")}, strict=False
        )
        return fresh
    return accelerator.unwrap_model(model).head if accelerator.is_main_process else None
