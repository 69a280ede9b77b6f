"""What a training run was trained under, so a rerun never mixes two runs in one head
(DESIGN §2, fingerprints).

Every checkpoint's state.json carries `settings`: the recipe values that shape the
trained weights (the head, the training hyperparameters, the features and the digest of
the prepared data) as a flat `section.key -> value` dict. A rerun compares its own
settings with the newest checkpoint's before it loads anything: a finished run is left
as it is, a changed one is refused with the keys that differ unless the user says to
continue (`--accept-changes`) or to start anew (`--restart`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.data.prepare import read_prepared_digest
from eyas.train.checkpoint import TrainerState, latest_checkpoint, read_trainer_state

log = logging.getLogger(__name__)

# train.* keys that say how a run is watched, saved or scheduled on the machine, not
# what it learns: changing them never makes a resumed run another run.
OPERATIONAL_TRAIN_KEYS = frozenset(
    {
        "eval_every",
        "save_every",
        "keep_checkpoints",
        "log_every",
        "logger",
        "eval_batches",
        "resume",
        "cpu_threads",
        "compile_loss",
        "max_nonfinite_steps",
        "max_minutes",
    }
)


# Keys added after runs were recorded, left out while at the value every earlier run
# trained with: a checkpoint from before them then still matches the recipe it was
# trained with.
LATER_KEYS_OMITTED_AT = {
    "head.sliding_window": None,
    "train.loss": "kl",
    "train.lk_eta": 3.0,
    "train.optimizer": "adamw",
    "train.muon_lr": 0.02,
    # P-EAGLE runs before it drew deeper elements at every position (a rerun of one from
    # then is told the sampling changed)
    "train.peagle.cod_labelled_only": False,
    "data.max_samples": None,  # recorded only on another run's data (data.from_run)
}


class RerunRefused(ValueError):
    """A rerun would mix two runs in one run dir (changed settings, or checkpoints of an
    earlier run under train.resume=false); the message says what to pass instead."""


def _flat(prefix: str, tree: dict, out: dict) -> None:
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            _flat(name, value, out)
        else:
            out[name] = value


def training_settings(recipe, data_digest: str | None) -> dict[str, Any]:
    """The settings of `recipe` that shape the weights, flat and JSON-ready."""
    tree = recipe.model_dump(mode="json")
    out: dict[str, Any] = {}
    _flat("head", tree["head"], out)
    _flat("train", {k: v for k, v in tree["train"].items() if k not in OPERATIONAL_TRAIN_KEYS}, out)
    for key in ("features", "aux_layer_ids"):
        out[f"data.{key}"] = tree["data"][key]
    for key in ("name_or_path", "revision"):
        out[f"target.{key}"] = tree["target"][key]
    out["prepared.digest"] = data_digest
    # on another run's data, the conversations of it trained on (data/from_run.py)
    out["data.max_samples"] = tree["data"]["max_samples"] if tree["data"]["from_run"] else None
    for key, before in LATER_KEYS_OMITTED_AT.items():
        if key in out and out[key] == before:
            out.pop(key)
    return json.loads(json.dumps(out))  # tuples -> lists, as they come back from state.json


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every setting that differs (a key only one side has counts)."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if a != b:
            if key == "prepared.digest":
                changes.append("the prepared data (run `eyas prepare` again since?)")
            else:
                changes.append(f"{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return changes


# --- the decision, before the target loads (train/loop.py) -----------------------------


@dataclass
class EarlierRun:
    """The run directory's newest checkpoint and how this recipe relates to it."""

    settings: dict  # this recipe's `training_settings`
    latest: Path | None = None
    saved: TrainerState | None = None
    finished: bool = False
    changes: list[str] = field(default_factory=list)  # setting keys that differ from the checkpoint's


def read_earlier_run(recipe, accelerator, restart: bool, accept_changes: bool) -> EarlierRun:
    """Decided before the target loads (minutes for a large one): a finished run is left as
    it is, a changed one refused, before anything is written. `restart` first deletes what
    an earlier run trained."""
    cfg, paths = recipe.train, recipe.paths
    ckpt_root = paths.checkpoints
    settings = training_settings(recipe, read_prepared_digest(paths.prepared))
    if restart and accelerator.is_main_process:
        clear_run(paths)
    accelerator.wait_for_everyone()
    latest = latest_checkpoint(ckpt_root)
    if latest is None:
        return EarlierRun(settings)
    if not cfg.resume:
        raise RerunRefused(
            f"{ckpt_root} holds checkpoints of an earlier run and train.resume is false: pass "
            "--restart to delete them and start anew, or set run_dir to a new directory"
        )
    saved = read_trainer_state(latest)
    finished = saved.total_steps > 0 and saved.step >= saved.total_steps and (ckpt_root / "final").is_dir()
    changes = changed_settings(saved.settings, settings) if saved.settings else []
    if not saved.settings:
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
    return EarlierRun(settings, latest, saved, finished, changes)


def clear_run(paths) -> None:
    """`--restart`: remove what an earlier run trained (checkpoints, the final head, its
    metrics and recipe); the prepared data and the cache stay."""
    import shutil

    shutil.rmtree(paths.checkpoints, ignore_errors=True)
    for path in (paths.metrics, paths.recipe):
        path.unlink(missing_ok=True)
    log.info("--restart: removed the checkpoints, head and metrics of the earlier run in %s", paths.root)
