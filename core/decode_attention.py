"""Which SDPA call a one-token decode step of a grouped-query target makes on a CPU
(DESIGN §2.3, the hf regeneration backend).

transformers' SDPA attention can hand torch the grouped key/value heads (`enable_gqa`,
forced by `TRANSFORMERS_SDPA_FORCE_GQA=1` under a padding mask) or, for one query, fold the
query heads of a group into the query axis and attend the key/value heads as they are
(its default). Which is faster depends on the processor, not on its flags: on a Xeon with
AMX the grouped kernel was faster; on an EPYC with AVX512-BF16 and no AMX it is several
times slower in bf16 (docs/experiments.md, 2026-12-06). So the choice is timed once at the
target's own decode shape, in both ways, and cached per machine, torch version, thread
count and shape in `~/.cache/eyas/decode_attention.json` (beside the precision verdicts,
core/precision.py; delete the file to measure again). A value the user exported is kept.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from eyas.core.precision import fastest_seconds, machine_id, read_verdicts, write_verdicts

log = logging.getLogger(__name__)

GQA_SDPA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
CACHE_NAME = "decode_attention.json"
# Keys a decode query attends to in the timing: a short chat's prompt and reply.
TIMED_KEYS = 256
MAX_TIMED_ROWS = 256
# What eyas last wrote to the variable: any other value present is the user's.
_WRITTEN: dict[str, str] = {}


@dataclass(frozen=True)
class DecodeShapes:
    """One decode step's attention: `rows` sequences, `heads` query heads sharing
    `kv_heads` key/value heads of `head_dim`, over `keys` cached positions."""

    rows: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    keys: int = TIMED_KEYS

    def key(self) -> str:
        return (
            f"{machine_id()}|{self.rows}x{self.heads}/{self.kv_heads}x{self.head_dim}"
            f"x{self.keys}|{self.dtype}"
        )


def decode_shapes(config, dtype: torch.dtype, rows: int) -> DecodeShapes | None:
    """The decode attention shape of a transformers config; None without grouped heads."""
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if kv_heads == heads or heads % kv_heads:
        return None
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    dtype_name = str(dtype).removeprefix("torch.")
    return DecodeShapes(max(1, min(rows, MAX_TIMED_ROWS)), heads, kv_heads, head_dim, dtype_name)


def time_decode_attention(shapes: DecodeShapes, grouped: bool, seconds: float = 0.1) -> float:
    """Seconds for one decode query's attention, as transformers' SDPA path calls torch:
    grouped (`enable_gqa`) or folded (the query heads of a group on the query axis); the
    fastest of repeated runs over about `seconds`, under an additive left-padding mask."""
    s, dtype = shapes, getattr(torch, shapes.dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s.rows, s.heads, 1, s.head_dim, generator=gen).to(dtype)
    k = torch.randn(s.rows, s.kv_heads, s.keys, s.head_dim, generator=gen).to(dtype)
    v = torch.randn(s.rows, s.kv_heads, s.keys, s.head_dim, generator=gen).to(dtype)
    mask = torch.zeros(s.rows, 1, 1, s.keys, dtype=dtype)
    mask[:, :, :, : s.keys // 8] = torch.finfo(dtype).min  # left padding, as a batch has
    if not grouped:
        q = q.reshape(s.rows, s.kv_heads, s.heads // s.kv_heads, s.head_dim)

    return fastest_seconds(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped), seconds
    )


def grouped_decode_is_faster(shapes: DecodeShapes) -> bool:
    """Whether the grouped SDPA call beats the folded one for `shapes` on this CPU:
    measured once (two alternating rounds, the fastest of each), then read from the cache."""
    verdicts = read_verdicts(CACHE_NAME)
    known = verdicts.get(shapes.key())
    if isinstance(known, dict) and isinstance(known.get("grouped"), bool):
        return known["grouped"]
    rounds = [(time_decode_attention(shapes, True), time_decode_attention(shapes, False)) for _ in range(2)]
    grouped_s, folded_s = min(r[0] for r in rounds), min(r[1] for r in rounds)
    verdicts[shapes.key()] = {
        "grouped": grouped_s < folded_s,
        "grouped_ms": round(grouped_s * 1e3, 3),
        "folded_ms": round(folded_s * 1e3, 3),
        "shapes": asdict(shapes),
    }
    write_verdicts(CACHE_NAME, verdicts)
    log.info(
        "decode attention on this CPU: %s (grouped %.2f ms, folded %.2f ms for %s)",
        "grouped" if grouped_s < folded_s else "folded",
        grouped_s * 1e3,
        folded_s * 1e3,
        asdict(shapes),
    )
    return grouped_s < folded_s


def choose_gqa_sdpa_on_cpu(config, dtype: torch.dtype, rows: int) -> None:
    """Set `TRANSFORMERS_SDPA_FORCE_GQA` for a CPU target: 1 where the grouped decode call
    is the faster here, else 0 (transformers' folded default). Not for GPUs, where
    transformers says a masked grouped call falls back to the unfused kernel."""
    present = os.environ.get(GQA_SDPA_ENV)
    if present is not None and present != _WRITTEN.get(GQA_SDPA_ENV):
        return
    shapes = decode_shapes(config, dtype, rows)
    if shapes is not None:
        value = "1" if grouped_decode_is_faster(shapes) else "0"
        os.environ[GQA_SDPA_ENV] = _WRITTEN[GQA_SDPA_ENV] = value
