"""Full-state training checkpoints, written atomically, and resume from the latest.

Layout of `run_dir/checkpoints/`:

  step-00000500/            one directory per saved step (the newest `keep` are kept)
    state.json             step, data position, non-finite counters, scheduler state
    model.safetensors      the head (`head_state_dict`: the frozen target embedding left out)
    optimizer.pt           optimizer state (tensors and numbers; read with weights_only=True)
    rng-rank{r}.safetensors  torch CPU / CUDA RNG and the loss generator of rank r
    accelerate/            (DeepSpeed only) the engine's own sharded model+optimizer

Under FSDP2 (eyas's own sharding, design §2.8) the head and optimizer are gathered into
full, unsharded state and written as model.safetensors / optimizer.pt like a plain run's,
so such a checkpoint resumes under any strategy but DeepSpeed and exports as usual.
  final/                   the trained head (`eyas.heads.io.save_head`), read by `eyas export`

A checkpoint is written into `.tmp-step-N` and renamed when complete, so a kill at any
moment leaves the previous checkpoint usable; a `.tmp-*` left by a kill is removed on the
next save. Nothing here is unpickled: optimizer state loads with `weights_only=True`, and
so do DeepSpeed's own files (`weights_only_loads`: its checkpoint engine would unpickle).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.heads.io import head_state_dict

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_NAME = "state.json"


@dataclass
class TrainerState:
    """What besides tensors a resumed run needs."""

    step: int = 0
    epoch: int = 0
    batches: int = 0  # micro-batches of `epoch` consumed, over all ranks
    nonfinite_total: int = 0
    nonfinite_run: int = 0
    scheduler: dict = field(default_factory=dict)
    world_size: int = 1
    total_steps: int = 0  # the run's length when this was saved (0: written before it was kept)
    settings: dict = field(default_factory=dict)  # train/run_settings.py: what the weights were trained under
    changes: list = field(default_factory=list)  # [{"step", "changes"}]: settings changed on a resume
    logger_run_id: str = ""  # the wandb run a resumed training continues

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        return cls(**json.loads(text))


def read_trainer_state(path: str | Path) -> TrainerState:
    """The state.json of checkpoint `path`, without loading any tensor."""
    return TrainerState.from_json((Path(path) / STATE_NAME).read_text())


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first, as (step, dir)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / STATE_NAME).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def rng_tensors(generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"torch_cuda_{i}"] = s
    if generator is not None:
        state["loss_generator"] = generator.get_state()
    return state


def restore_rng(state: dict[str, torch.Tensor], generator: torch.Generator | None) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda = [state[k] for k in sorted(k for k in state if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if generator is not None and "loss_generator" in state:
        generator.set_state(state["loss_generator"])


class UnsafeCheckpointError(RuntimeError):
    """An engine checkpoint file holds a type eyas does not unpickle."""


class CheckpointMismatchError(ValueError):
    """A checkpoint written for other trainable parameters than this run's head has."""


# Types DeepSpeed writes into its ZeRO checkpoint files besides tensors and builtins: data
# holders (an enum, a named tuple, the loss scalers' counters) that load with
# weights_only=True once allowed by name.
DEEPSPEED_CHECKPOINT_TYPES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _allowed_engine_types() -> list:
    import importlib

    found = []
    for name in DEEPSPEED_CHECKPOINT_TYPES:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # not installed, or another DeepSpeed version
            pass
    return found


@contextmanager
def weights_only_loads():
    """Every `torch.load` inside reads with weights_only=True: DeepSpeed's checkpoint
    engine asks for weights_only=False (full unpickling) on its own files."""
    original = torch.load
    allowed = _allowed_engine_types()

    def load(f, map_location=None, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, map_location=map_location, **kwargs)
        except pickle.UnpicklingError as err:
            named = re.search(r"GLOBAL ([\w.]+)", str(err))
            what = f"the type {named.group(1)}" if named else "a type"
            raise UnsafeCheckpointError(
                f"{f}: holds {what}, which eyas does not unpickle; nothing was loaded. "
                "Resume from a checkpoint eyas wrote, or pass --restart"
            ) from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def uses_engine_state(accelerator) -> bool:
    """DeepSpeed (and accelerate's own FSDP, which eyas never asks for) shard model/optimizer
    state: only their own save/load is right."""
    return accelerator.distributed_type.name in ("DEEPSPEED", "FSDP")


def is_fsdp(model) -> bool:
    """Whether `model` was sharded with FSDP2 (`fully_shard`, train/distributed.py)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FSDPModule)


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model) -> dict[str, torch.Tensor]:
    """The unsharded state dict of an FSDP2 model (a collective: every rank calls it); the
    tensors on rank 0, an empty dict on the others."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options())


def _trainable_names(model) -> list[str]:
    # the order the loop builds its optimizer in: model.parameters() that require grad
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _fsdp_optimizer_state(model, optimizer) -> dict:
    """The full optimizer state of an FSDP2 model in `Optimizer.state_dict()`'s own layout
    (parameters by index), so a plain run loads it unchanged. Collective; rank 0 only."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, _raw(optimizer), options=_full_options())
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    return {
        "state": {index[n]: v for n, v in by_name.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in by_name.get("param_groups", [])
        ],
    }


def _load_fsdp(path: Path, model, optimizer) -> None:
    """Shard a full (plain-layout) checkpoint into an FSDP2 model and its optimizer; every
    rank reads the files."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = load_file(str(path / "model.safetensors"))
    head = model.head
    expected = set(head.state_dict())
    if not head.trains_embedding:
        expected.discard("embed_tokens.weight")
    if set(weights) != expected:
        raise ValueError(
            f"{path / 'model.safetensors'}: missing {sorted(expected - set(weights))}, "
            f"unexpected {sorted(set(weights) - expected)}"
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, {f"head.{k}": v for k, v in weights.items()}, options=options)
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    names = _trainable_names(model)
    by_name = {
        "state": {names[int(i)]: v for i, v in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, _raw(optimizer), by_name, options=StateDictOptions(full_state_dict=True))


def _raw(optimizer):
    """The torch optimizer under accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save_checkpoint(
    root: str | Path,
    accelerator,
    model,
    optimizer,
    state: TrainerState,
    generator: torch.Generator | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step-<state.step>` atomically (every rank calls this). `model` is
    the prepared (wrapped) module whose unwrapped form has a `.head`."""
    root = Path(root)
    final = root / step_dir_name(state.step)
    tmp = root / (".tmp-" + final.name)
    if accelerator.is_main_process:
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if is_fsdp(model):
        full = full_model_state(model)  # collectives: every rank takes part
        optim = _fsdp_optimizer_state(model, optimizer)
        if accelerator.is_main_process:
            head = {k[len("head.") :]: v.contiguous() for k, v in full.items() if k.startswith("head.")}
            if not model.head.trains_embedding:
                head.pop("embed_tokens.weight", None)
            save_file(head, str(tmp / "model.safetensors"))
            torch.save(optim, tmp / "optimizer.pt")
    elif uses_engine_state(accelerator):
        accelerator.save_state(str(tmp / "accelerate"))
    elif accelerator.is_main_process:
        head = accelerator.unwrap_model(model).head
        save_file(head_state_dict(head), str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    save_file(
        {k: v.contiguous() for k, v in rng_tensors(generator).items()},
        str(tmp / f"rng-rank{accelerator.process_index}.safetensors"),
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # state.json last: its presence marks a complete checkpoint.
        (tmp / STATE_NAME).write_text(state.to_json())
        if final.exists():  # a re-save of the same step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(
    path: str | Path, accelerator, model, optimizer, generator: torch.Generator | None = None
) -> TrainerState:
    """Restore a checkpoint written by `save_checkpoint` into the prepared objects."""
    path = Path(path)
    state = read_trainer_state(path)
    if is_fsdp(model):
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"{path}: a DeepSpeed checkpoint; resume it with the same launcher config")
        _load_fsdp(path, model, optimizer)
    elif uses_engine_state(accelerator):
        if not (path / "accelerate").is_dir():
            raise ValueError(f"{path}: written without DeepSpeed; resume it with the same launcher config")
        with weights_only_loads():
            accelerator.load_state(str(path / "accelerate"))
    else:
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"{path}: a DeepSpeed checkpoint; resume it with the same launcher config")
        head = accelerator.unwrap_model(model).head
        # read on the CPU (safetensors refuses "cpu:0", the device of a gloo rank), then copied in
        weights = load_file(str(path / "model.safetensors"))
        missing, unexpected = head.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not (k == "embed_tokens.weight" and not head.trains_embedding)]
        if missing or unexpected:
            raise ValueError(f"{path / 'model.safetensors'}: missing {missing}, unexpected {unexpected}")
        # on the CPU ("cpu:0", a gloo rank's device, is no map_location); load_state_dict moves it
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        try:
            optimizer.load_state_dict(saved)
        except ValueError as err:
            # e.g. a P-EAGLE run from before the head learned only its mask row (its optimizer
            # held the whole embedding table)
            raise CheckpointMismatchError(
                f"{path / 'optimizer.pt'}: its optimizer state does not fit this head's trainable "
                f"parameters ({err}); it was written for another set of them (another eyas version "
                "or head). Rerun with --restart, or export the checkpoint and start a run from it "
                "with train.init_from"
            ) from err
    rng_file = path / f"rng-rank{accelerator.process_index}.safetensors"
    if rng_file.is_file():
        restore_rng(load_file(str(rng_file)), generator)
    return state
