"""The accelerate / DeepSpeed / FSDP plumbing of the training loop (DESIGN §2.4, §2.8): which
device, process group and mixed precision a run gets, the DeepSpeed JSON's "auto" fields,
the FSDP2 sharding eyas applies itself, the collectives the loop needs, reading the
trained head back out of a sharded engine, and a warning for the build lock that would
hang DeepSpeed's first op build.

`train/loop.py` calls these and stays a plain recipe; nothing here decides what is trained.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from eyas.core.precision import resolve_mixed_precision, shapes_of_config
from eyas.train.checkpoint import full_model_state, is_fsdp, uses_engine_state

log = logging.getLogger(__name__)


def runs_on_cpu(recipe) -> bool:
    """Whether accelerate is told to use the CPU. DeepSpeed picks its own device
    (DS_ACCELERATOR=cpu on a CPU machine), so it is never told."""
    device = recipe.target.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return on_cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true"


def fsdp_requested() -> bool:
    """Whether the launcher config asks for FSDP (`distributed_type: FSDP` sets
    ACCELERATE_USE_FSDP). `make_accelerator` moves the request to EYAS_FSDP: eyas shards the
    head itself (design §2.8), so accelerate is told nothing about FSDP."""
    return any(os.environ.get(k, "false").lower() == "true" for k in ("ACCELERATE_USE_FSDP", "EYAS_FSDP"))


# A torch-extension build lock older than this is taken for one a killed build left behind.
STALE_LOCK_SECONDS = 600


def stale_extension_locks(now: float | None = None) -> list[tuple[Path, float]]:
    """(lock file, age in seconds) of each torch-extension build lock older than
    STALE_LOCK_SECONDS. torch's JIT build (DeepSpeed's ops on first use, e.g. its CPU
    `shm_comm`) waits, silently and forever, while its directory holds a `lock`; a build
    killed midway (Ctrl-C during a first launch) leaves one."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    found = []
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # a build just finished
            continue
        if age > STALE_LOCK_SECONDS:
            found.append((lock, age))
    return found


def warn_stale_extension_locks() -> None:
    """Name each stale torch-extension lock before DeepSpeed builds its ops, so a launch
    that then hangs has said why."""
    for lock, age in stale_extension_locks():
        log.warning(
            "%s is a torch-extension build lock %.0f min old: a build of that op waits on it "
            "forever (DeepSpeed builds its ops on first use). A build killed midway leaves it; "
            "if no build is running, delete it",
            lock,
            age / 60,
        )


def make_accelerator(recipe, target=None):
    """The run's `Accelerator`: gradient accumulation from the recipe, the mixed precision
    for its device, and a process group that works without a GPU."""
    from accelerate import Accelerator

    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and os.environ.get("LOCAL_RANK", "0") == "0":
        warn_stale_extension_locks()

    if fsdp_requested():
        # accelerate 1.16 applies its FSDP plugin only on GPUs (on CPU processes it silently
        # runs DDP); eyas wraps every head decoder layer with FSDP2 itself on any device.
        os.environ["EYAS_FSDP"], os.environ["ACCELERATE_USE_FSDP"] = "true", "false"

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
            "FSDP2" if fsdp_requested() else accelerator.distributed_type.name,
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


@contextmanager
def whole_target_loading():
    """Load the frozen target unpartitioned under a DeepSpeed ZeRO-3 config: transformers'
    ZeRO-3 integration would otherwise partition it at load (every rank then sees size-0
    tensors). The target is replicated per rank; only the head is sharded."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # pragma: no cover - transformers always ships it
        yield
        return
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def shard_head(accelerator, model):
    """FSDP2 (`fully_shard`) over each head decoder layer, then the rest of the head as the
    root unit, when the launcher config asks for FSDP; otherwise `model` unchanged. Runs
    before the optimizer is built: sharding replaces the parameters by DTensors."""
    if not fsdp_requested():
        return model
    from torch.distributed.fsdp import fully_shard

    if accelerator.num_processes < 2:
        log.warning("FSDP asked for with one process: the head is not sharded")
        return model
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in ("false", "0")
    layers = list(model.head.layers)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if accelerator.is_main_process:
        log.info(
            "FSDP2: %d decoder layer(s) and the root sharded over %d processes",
            len(layers),
            accelerator.num_processes,
        )
    return model


def prepare(accelerator, model, optimizer, cfg):
    """Wrap the head-with-loss and its optimizer for the launcher (DDP, DeepSpeed); a head
    eyas sharded with FSDP2 is not handed over (accelerate would wrap it in DDP), only its
    optimizer. The scheduler is not handed over either: registered with accelerate it would
    be stepped once per process and pickled into checkpoints (loaded back with
    weights_only=False), so the loop steps it and its state travels in state.json."""
    fill_deepspeed_config(accelerator, cfg)
    if is_fsdp(model):
        return model, accelerator.prepare(optimizer)
    _refuse_zero3_with_own_parameters(accelerator, model)
    return accelerator.prepare(model, optimizer)


def _refuse_zero3_with_own_parameters(accelerator, model) -> None:
    """ZeRO-3 gathers a module's own parameters only around that module's forward and
    backward, and the loss calls the head's parts, never the head itself: a parameter the
    head holds directly (P-EAGLE's `mask_hidden`) stays partitioned (size 0) in the
    backward. Refused up front rather than failing mid-step."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return
    own = [name for name, p in model.head.named_parameters(recurse=False) if p.requires_grad]
    if own:
        raise ValueError(
            f"DeepSpeed ZeRO-3 cannot train this {model.head.config.algorithm} head: it holds "
            f"{', '.join(own)} itself, which ZeRO-3 leaves partitioned in the backward. Launch it "
            "with recipes/accelerate/deepspeed_zero2.yaml or recipes/accelerate/fsdp.yaml"
        )


def clip_gradients(accelerator, model, params, max_norm: float) -> torch.Tensor | None:
    """Clip the gradients to `max_norm` (their global norm over every rank and shard) and
    return the norm before clipping; None under DeepSpeed, which clips inside its own step
    (gradient_clipping, filled from the recipe)."""
    if max_norm <= 0 or uses_engine_state(accelerator):
        return None
    norm = accelerator.clip_grad_norm_(params, max_norm)
    if norm is not None and hasattr(norm, "full_tensor"):  # FSDP2: a DTensor of partial norms
        norm = norm.full_tensor()
    return norm


def any_rank_nonfinite(accelerator, loss: torch.Tensor) -> bool:
    """Whether the loss is non-finite on any rank, so every rank skips the same update."""
    return _on_any_rank(accelerator, ~torch.isfinite(loss.detach()))


def any_rank_past(accelerator, deadline: float) -> bool:
    """Whether `time.monotonic()` has passed `deadline` on any rank, so every rank stops
    after the same step (ranks that stopped apart would wait on each other's collectives)."""
    return _on_any_rank(accelerator, torch.tensor(time.monotonic() > deadline, device=accelerator.device))


def _on_any_rank(accelerator, flag: torch.Tensor) -> bool:
    flag = flag.float()
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, reduction="sum")
    return flag.item() > 0


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

    if is_fsdp(model) or uses_engine_state(accelerator):
        full = full_model_state(model) if is_fsdp(model) else accelerator.get_state_dict(model)
        if not accelerator.is_main_process:
            return None
        fresh = build_head(head_cfg)
        fresh.load_state_dict(
            {k[len("head.") :]: v for k, v in full.items() if k.startswith("head.")}, strict=False
        )
        return fresh
    return accelerator.unwrap_model(model).head if accelerator.is_main_process else None
