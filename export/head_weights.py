"""The weights of a head directory (DESIGN §5.1): one safetensors file or the shards an
index names, under the speculators tensor names. A directory with only a pickle is
refused by name, with the command that converts it; nothing here unpickles."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from eyas.export.head_dir import read_config
from eyas.export.writer import WEIGHTS_NAME, ExportFormatError

WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def pickle_refusal(d: Path) -> str:
    return (
        f"{d} holds its weights only as a pickle "
        f"({', '.join(n for n in PICKLE_WEIGHTS if (d / n).is_file())}); "
        f"eyas and vLLM's safetensors path read {WEIGHTS_NAME}. Convert it once (weights only, no code "
        f"runs): "
        f'python -c "import torch; from safetensors.torch import save_file; '
        f"save_file(torch.load('{d / 'pytorch_model.bin'}', weights_only=True), '{d / WEIGHTS_NAME}')\""
    )


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of a head directory (one file, or the shards an index names);
    ExportFormatError when there are none (a pickle-only directory is named as such)."""
    if (d / WEIGHTS_NAME).is_file():
        return [d / WEIGHTS_NAME]
    index = d / WEIGHTS_INDEX
    if index.is_file():
        weight_map = read_config(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportFormatError(f"{index}: no weight_map")
        files = [d / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ExportFormatError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    if any((d / n).is_file() for n in PICKLE_WEIGHTS):
        raise ExportFormatError(pickle_refusal(d))
    raise ExportFormatError(f"{d / WEIGHTS_NAME} is missing")


def read_tensors(head_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head directory's safetensors file(s); a damaged file is named."""
    out = {}
    for path in weight_files(Path(head_dir)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except Exception as err:  # a truncated or foreign file
            raise ExportFormatError(f"{path} cannot be read: {err}") from None
    return out


def canonical_tensor_name(name: str) -> str:
    """The EAGLE layout's `midlayer.*` (layer 0, also beside `layers.1..` in amazon's
    P-EAGLE heads) is the speculators `layers.0.*`."""
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def canonical_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors under the speculators names; amazon's P-EAGLE `mask_hidden` [1, 1, n·Ht]
    is the [1, n·Ht] vector (vLLM broadcasts either)."""
    out = {}
    for name, t in tensors.items():
        name = canonical_tensor_name(name)
        if name == "mask_hidden" and t.dim() == 3 and t.shape[:2] == (1, 1):
            t = t.reshape(1, -1)
        out[name] = t
    return out
