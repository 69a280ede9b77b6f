"""The handover of one request's hidden states from a serving engine to eyas (DESIGN §2.3):
the one schema both sides use. It runs in two Pythons: inside the engine (vLLM's venv,
imported as the top-level module `eyas_states_format`, see eyas_states_connector.py) and
in eyas (`eyas.data.vllm_plugin.eyas_states_format`); so it imports only torch and
safetensors, which both have.

Per request, in the engine's handover directory, under the key the client chose:

  <key>.safetensors   states [T, m, H] in the engine's dtype (m = len(layer_ids), the
                               residual stream after `layer_ids[j]` decoder layers),
                      token_ids [T] int64 (the prompt the states are of)
  <key>.json          {"format": FORMAT, "version": 1, "key", "file", "bytes", "sha256",
                       "num_tokens", "layer_ids", "hidden_size", "dtype", "engine"}

The tensor file is renamed into place before the record, and the record last: a record
that is there names a complete tensor file, whose checksum the reader checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

FORMAT = "eyas-engine-states"
VERSION = 1
# the request's `kv_transfer_params` entry that names where its states go
KEY_PARAM = "eyas_key"
_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class HandoverError(RuntimeError):
    """A handover record is damaged or does not match what was asked (the message names it)."""


def check_key(key: str) -> str:
    """A key is a file name stem: letters, digits, `_.-`; anything else could leave the
    handover directory."""
    if not isinstance(key, str) or not _KEY.match(key) or key.startswith("."):
        raise HandoverError(f"handover key {key!r}: use 1-200 of A-Z a-z 0-9 _ . - (not leading '.')")
    return key


def record_path(directory: str | Path, key: str) -> Path:
    return Path(directory) / f"{check_key(key)}.json"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_states(
    directory: str | Path,
    key: str,
    states: torch.Tensor,
    token_ids: torch.Tensor,
    layer_ids: list[int],
    engine: str = "",
) -> Path:
    """Write one request's states [T, m, H] and prompt token ids [T]; returns the record's path."""
    from safetensors.torch import save

    if states.dim() != 3 or states.shape[0] != token_ids.shape[0] or states.shape[1] != len(layer_ids):
        raise HandoverError(
            f"{key}: states {tuple(states.shape)} do not fit {token_ids.shape[0]} tokens x "
            f"{len(layer_ids)} layers"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{check_key(key)}.safetensors"
    data = save({"states": states.contiguous(), "token_ids": token_ids.to(torch.int64).contiguous()})
    _atomic_write(directory / name, data)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "key": key,
        "file": name,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "num_tokens": int(states.shape[0]),
        "layer_ids": [int(i) for i in layer_ids],
        "hidden_size": int(states.shape[2]),
        "dtype": str(states.dtype).removeprefix("torch."),
        "engine": engine,
    }
    path = record_path(directory, key)
    _atomic_write(path, json.dumps(record).encode())
    return path


def read_states(directory: str | Path, key: str) -> tuple[dict, torch.Tensor, torch.Tensor] | None:
    """(record, states [T, m, H], token_ids [T]) of `key`, or None while its record is not
    written yet; a record or tensor file that is damaged raises HandoverError naming it."""
    from safetensors.torch import load

    path = record_path(directory, key)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HandoverError(f"{path}: not a handover record ({err})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != VERSION:
        raise HandoverError(f"{path}: not a {FORMAT} v{VERSION} record")
    f = Path(directory) / record["file"]
    if not f.is_file():
        raise HandoverError(f"{f}: missing (its record {path} is there)")
    data = f.read_bytes()
    if len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise HandoverError(f"{f}: checksum mismatch with {path} (damaged)")
    tensors = load(data)
    states, ids = tensors["states"], tensors["token_ids"]
    want = (record["num_tokens"], len(record["layer_ids"]), record["hidden_size"])
    if tuple(states.shape) != want or tuple(ids.shape) != want[:1]:
        raise HandoverError(f"{f}: states {tuple(states.shape)}, the record {path} says {want}")
    return record, states, ids


def remove_states(directory: str | Path, key: str) -> None:
    """Remove a request's record and tensor file (once its states are in the cache)."""
    directory = Path(directory)
    (directory / f"{check_key(key)}.json").unlink(missing_ok=True)
    (directory / f"{key}.safetensors").unlink(missing_ok=True)
