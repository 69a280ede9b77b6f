"""Flex attention for the head's block masks (P-EAGLE training on CUDA, DESIGN §4): the
compiled kernel, the shape buckets it is compiled for, and the tile sizes it runs with."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


FLEX_MIN_LENGTH = 128  # flex attention's block: a shorter sequence is one block anyway
FLEX_RECOMPILE_LIMIT = 128  # more than the (rows, length) buckets a run can meet


def flex_bucket(n: int, least: int = 1) -> int:
    """The size flex attention runs at for `n` rows or elements: the next power of two, at
    least `least`. The compiled kernel is specialised to its shapes, and past dynamo's
    recompile limit (8 by default) dynamo runs flex eagerly, an unfused reference that
    materialises every score (out of memory at GPT-OSS's P-EAGLE segments); P-EAGLE's
    element count is new every batch, so shapes are rounded to these few sizes. Padding
    elements attend only to themselves: their blocks are skipped but the diagonal."""
    return max(least, 1 << max(0, n - 1).bit_length())


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once per process: run eagerly it falls back to an unfused
    reference that materialises every score and skips no masked block. Each shape bucket
    (`flex_bucket`) compiles once; the recompile limit is raised to hold them all."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


def _pad_rows_and_length(x: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """x [B, heads, L, D] zero-padded to [rows, heads, length, D]."""
    return F.pad(x, (0, 0, 0, length - x.shape[2], 0, 0, 0, rows - x.shape[0]))


def flex_kernel_options(q: torch.Tensor) -> dict | None:
    """Tile sizes for flex attention where its own choice is slow: at head_dim 64 on a GPU
    (GPT-OSS, SmolLM2, Llama-3.2 heads) torch picked a forward 30x slower than at head_dim
    128 for the same mask and FLOPs; these tiles took the forward from 506 to 28 ms and
    forward + backward from 577 to 99 ms (GPT-OSS-20B P-EAGLE shape, H200, torch 2.11;
    scripts/bench_flex_attention.py repeats the measurement). None: torch's choice."""
    if q.device.type == "cuda" and q.shape[-1] == 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    return None


_flex_options_failed: list[str] = []  # the error, once a torch refused the tiles above


def flex_block_attention(q, keys, values, block_mask, scale: float, gqa: bool) -> torch.Tensor:
    """Compiled flex attention over a BlockMask, with `flex_kernel_options`; a torch whose
    flex rejects those tiles gets its own choice (warned once) instead of a failed run.
    A mask built for more rows or a longer sequence (`flex_bucket`) gets q, keys and values
    zero-padded to its shape, and the output cut back."""
    b, n = q.shape[0], q.shape[2]
    if block_mask is not None:
        rows, _, q_len, kv_len = block_mask.shape
        if (rows, q_len, kv_len) != (b, n, keys.shape[2]):
            q = _pad_rows_and_length(q, rows, q_len)
            keys, values = (_pad_rows_and_length(x, rows, kv_len) for x in (keys, values))
    return _flex_attention_with_options(q, keys, values, block_mask, scale, gqa)[:b, :, :n]


def _flex_attention_with_options(q, keys, values, block_mask, scale: float, gqa: bool) -> torch.Tensor:
    options = None if _flex_options_failed else flex_kernel_options(q)
    if options is not None:
        try:
            return _compiled_flex_attention()(
                q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options
            )
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:
            _flex_options_failed.append(f"{type(err).__name__}: {err}")
            log.warning(
                "flex attention refused kernel options %s; using torch's own: %s",
                options,
                _flex_options_failed[0][:500],
            )
    return _compiled_flex_attention()(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def is_block_mask(mask) -> bool:
    return mask is not None and type(mask).__name__ == "BlockMask"
