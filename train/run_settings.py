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
from typing import Any

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
        "num_workers",
        "compile_loss",
        "max_nonfinite_steps",
    }
)


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
