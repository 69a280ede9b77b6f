"""The settings of one capture job (DESIGN §2.3): built once from the recipe and the
target (`CaptureSettings.from_recipe`) and passed whole to `capture_split` for every
split, so a new setting is one field here and one line in the builder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CaptureSettings:
    aux_layer_ids: Sequence[int]  # the target layers whose states the head reads
    aux_dtype: str = "bf16"  # or "fp8": the aux states stored quantized (data/cache.py)
    batch_tokens: int = 8192  # padded tokens per forward batch
    shard_tokens: int = 262_144  # tokens per shard file, the unit a rerun resumes at
    pad_id: int = 0
    target_name: str = ""
    # The prepared directory's digest (meta.json), recorded so the trainer refuses a cache
    # of other prepared data; None leaves it out.
    prepared_digest: str | None = None
    hidden_size: int | None = None  # the target's; None: read from the model
    progress: bool = True

    @classmethod
    def from_recipe(
        cls,
        recipe,
        aux_layer_ids: Sequence[int],
        hidden_size: int,
        pad_id: int,
        prepared_digest: str | None,
        progress: bool = True,
    ) -> CaptureSettings:
        """From the recipe's data section, for a target with these aux layers, width and
        padding id."""
        return cls(
            aux_layer_ids=aux_layer_ids,
            aux_dtype=recipe.data.cache_dtype,
            batch_tokens=recipe.data.capture_batch_tokens,
            shard_tokens=recipe.data.shard_tokens,
            pad_id=pad_id,
            target_name=recipe.target.name_or_path,
            prepared_digest=prepared_digest,
            hidden_size=hidden_size,
            progress=progress,
        )
