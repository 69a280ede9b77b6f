"""Building blocks of a draft head: RMSNorm, rotary embeddings, attention with a KV cache,
and the decoder layer (layer 0 takes the 2H-wide [embedding, hidden] input, DESIGN §3).

Attention accepts three kinds of `mask`:
- a boolean tensor `[B|1, 1, Tq, Tk]` (True = may attend) over the cached keys followed by
  the new ones: SDPA on any device;
- a flex-attention `BlockMask` (CUDA): the same rule, compiled to skip masked blocks;
- `TTTMask`: the training-time-test rule of DESIGN §3 over the step chunks the cache
  holds (one per unrolled step), run as fused SDPA calls over blocks of queries.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from eyas.core.segments import segment_starts
from eyas.heads.config import DraftHeadConfig
from eyas.heads.explicit_attention import explicit_attention
from eyas.heads.flex_attention import flex_block_attention, is_block_mask
from eyas.heads.rope import apply_rope, rope_cos_sin, rope_frequencies

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 like the target's own norms."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LayerCache:
    """Keys and values one attention layer has seen, as a list of chunks `[B, Hkv, Ti, d]`
    (one chunk per call), with each key's position `[B, Ti]` (a sliding window reads
    them). Training keeps the chunks apart (TTT attends to them differently); inference
    reads them concatenated."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pos: list[torch.Tensor | None] = []

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        self.k.append(k)
        self.v.append(v)
        self.pos.append(positions)

    def concatenated(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.k) > 1:  # fold chunks once so later reads are cheap
            self.k, self.v = [torch.cat(self.k, dim=2)], [torch.cat(self.v, dim=2)]
            known = all(p is not None for p in self.pos)
            self.pos = [torch.cat(self.pos, dim=1) if known else None]
        return self.k[0], self.v[0]

    def positions(self) -> torch.Tensor | None:
        """The positions `[B, Tk]` of the keys `concatenated` returns (None: not recorded)."""
        self.concatenated()
        return self.pos[0]

    @property
    def length(self) -> int:
        return sum(k.shape[2] for k in self.k)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drop rejected draft entries)."""
        if self.length <= length:
            return
        k, v = self.concatenated()
        self.k, self.v = [k[:, :, :length]], [v[:, :, :length]]
        self.pos = [None if self.pos[0] is None else self.pos[0][:, :length]]


class HeadCache:
    """A KV cache for every layer of a head."""

    def __init__(self, num_layers: int):
        self.layers = [LayerCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)


class TTTMask:
    """Attention for TTT step k (DESIGN §3): the query at slot t sees the step-0 keys of
    slots s <= t of its sample and the key each step 1..k computed at slot t itself (the
    diagonals), over the flattened key axis `[step-0 keys, step-1 keys, ...]` the cache
    holds as one chunk per step.

    Built from `attention_mask` [B, T] (1 = real). Padding queries carry no loss; they are
    only kept from empty softmax rows (each sees its own slot), never hidden, which lets
    a right-padded batch (the collator's layout) run step 0 as plain causal attention:
    a real query's keys s <= t are all real there.

    Queries are taken in blocks of `block` slots: block [i0, i1) needs only the step-0
    keys [0, i1) and its own stretch [i0, i1) of each diagonal chunk, so a step costs
    ~T²/2 + k·T·block scores instead of (k+1)·T². Default: 64 on CPU (fastest measured
    at T=512 on the reference machine; 256 for a packed row), 256 elsewhere, where each
    call costs a launch.

    With a sliding `window` W the query at slot t of step k (position t + k) sees only
    keys at positions > t + k - W: step-0 keys of slots s >= t + k - W + 1, and diagonal
    j only while k - j < W. A block then reads step-0 keys [`start(k, i0, i1)`, i1) alone,
    so a step's scores and memory grow linearly with T.

    With `segments` [B, T] (packed rows, core/segments.py) a step-0 key counts only for
    queries of its own sample, and a block reads step-0 keys from the start of its first
    query's sample on, so a packed row costs about what its samples cost apart.
    """

    def __init__(
        self,
        attention_mask: torch.Tensor,
        block: int | None = None,
        window: int | None = None,
        segments: torch.Tensor | None = None,
    ):
        real = attention_mask.bool()
        self.length = real.shape[1]
        self.real = real
        # A packed row is one row where a bucketed batch has many: 64-slot blocks there make
        # many small calls, so packed rows take 256 on any device (docs/experiments.md,
        # "packing short samples into rows").
        cpu_block = 64 if segments is None else 256
        self.block = block or (cpu_block if real.device.type == "cpu" else 256)
        self.window = window
        self.right_padded = bool((real[:, 1:] <= real[:, :-1]).all())
        self.starts = None if segments is None else segment_starts(segments)
        # the most step-0 keys one query can see (its sample's length when packed)
        self.reach = self.length
        if self.starts is not None:
            self.reach = int((torch.arange(self.length, device=real.device) - self.starts).max()) + 1
        self._masks: dict[tuple, torch.Tensor] = {}

    def blocks(self) -> list[tuple[int, int]]:
        return [(i0, min(i0 + self.block, self.length)) for i0 in range(0, self.length, self.block)]

    def start(self, k: int, i0: int, i1: int) -> int:
        """The first step-0 key any query of the block [i0, i1) of step k may see (i1: none;
        deep steps of a small window see their own diagonals alone)."""
        # a packed block starts at its first query's sample, rounded down to 64 slots: the key
        # count then takes few values, and CPU kernels (oneDNN) are built per shape
        lo = 0 if self.starts is None else int(self.starts[:, i0].min()) // 64 * 64
        return lo if self.window is None else min(i1, max(lo, i0 + k - self.window + 1))

    def for_block(self, k: int, i0: int, i1: int, keep: bool = True) -> torch.Tensor:
        """The mask of step k for queries [i0, i1): `[B|1, 1, i1-i0, (i1-lo) + k·(i1-i0)]`
        bool (True = may attend) over step-0 keys [lo, i1) (lo = `start(k, i0, i1)`) then each
        step's keys [i0, i1). `keep`: cache it for the next layer and step (False: a long
        sequence's masks would hold T² entries)."""
        if (k, i0) in self._masks:
            return self._masks[(k, i0)]
        device = self.real.device
        lo = self.start(k, i0, i1)
        rows = torch.arange(i0, i1, device=device)[:, None]
        cols = torch.arange(lo, i1, device=device)[None, :]
        step0 = cols <= rows  # [c, i1 - lo]
        if self.window is not None:
            step0 = step0 & (rows + k - cols < self.window)
        if self.starts is not None:
            # same sample: equal starts (a padding run is a segment of its own, so a padding
            # query still sees itself)
            step0 = step0[None] & (self.starts[:, i0:i1, None] == self.starts[:, None, lo:i1])
        elif not self.right_padded:
            step0 = step0[None] & (self.real[:, None, lo:i1] | (cols == rows)[None])
        else:
            step0 = step0[None]
        eye = torch.eye(i1 - i0, dtype=torch.bool, device=device).expand(step0.shape[0], -1, -1)
        diagonals = [
            eye if self.window is None or k - j < self.window else eye & False for j in range(1, k + 1)
        ]
        allowed = torch.cat([step0, *diagonals], dim=-1)[:, None]
        if keep:
            self._masks[(k, i0)] = allowed
        return allowed

    def bias_for_block(self, k: int, i0: int, i1: int, keep: bool = True) -> torch.Tensor:
        """`for_block` as an additive float32 bias (0 = may attend, -inf = masked)."""
        if (k, i0, "bias") in self._masks:
            return self._masks[(k, i0, "bias")]
        allowed = self.for_block(k, i0, i1, keep)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        bias.masked_fill_(~allowed, float("-inf"))
        if keep:
            self._masks[(k, i0, "bias")] = bias
        return bias


# From this many slots on, a TTT query block's keys and mask are rebuilt in the backward
# (activation checkpointing) instead of kept: kept, they grow with T² (each block holds
# the step-0 keys before it), which at 32k tokens no longer fits a CPU's memory.
RECOMPUTE_FROM = 4096


def _ttt_block(q, k0, v0, diagonals_k, diagonals_v, mask: TTTMask, k, i0, i1, scale, keep: bool):
    lo = mask.start(k, i0, i1)
    keys = torch.cat([k0[:, :, lo:i1]] + [c[:, :, i0:i1] for c in diagonals_k], dim=2)
    values = torch.cat([v0[:, :, lo:i1]] + [c[:, :, i0:i1] for c in diagonals_v], dim=2)
    if q.device.type == "cpu":
        return explicit_attention(q, keys, values, mask.bias_for_block(k, i0, i1, keep), scale)
    return F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=mask.for_block(k, i0, i1, keep),
        scale=scale,
        enable_gqa=q.shape[1] != k0.shape[1],
    )


def _ttt_attention(q, cache: LayerCache, mask: TTTMask, scale: float) -> torch.Tensor:
    """q [B, H, T, d]; cache chunks [B, Hkv, T, d] (chunk 0 = step 0, chunk j = step j).

    One call per query block (see `TTTMask`), so no call sees the whole [T, (k+1)·T]
    key axis. On CPU each block runs `explicit_attention`, whose backward is ~3x faster
    there than the fused kernel's; elsewhere fused SDPA, and step 0 of a right-padded
    batch is one causal SDPA call. Past `RECOMPUTE_FROM` slots (under autograd) each block
    is checkpointed, so the step's memory grows linearly with T.
    """
    from torch.utils.checkpoint import checkpoint

    k = len(cache.k) - 1
    gqa = q.shape[1] != cache.k[0].shape[1]
    plain_causal = mask.right_padded and mask.window is None and mask.starts is None
    if k == 0 and plain_causal and q.device.type != "cpu":
        return F.scaled_dot_product_attention(
            q, cache.k[0], cache.v[0], scale=scale, is_causal=True, enable_gqa=gqa
        )
    recompute = mask.reach >= RECOMPUTE_FROM and torch.is_grad_enabled()
    outs = []
    for i0, i1 in mask.blocks():
        args = (q[:, :, i0:i1], cache.k[0], cache.v[0], cache.k[1:], cache.v[1:], mask, k, i0, i1, scale)
        if recompute:
            outs.append(checkpoint(_ttt_block, *args, False, use_reentrant=False))
        else:
            outs.append(_ttt_block(*args, True))
    return torch.cat(outs, dim=2)


class Attention(nn.Module):
    def __init__(self, cfg: DraftHeadConfig, in_features: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # float32 on the CPU, never cast with the module: bf16 frequencies would rotate
        # far positions wrongly (heads/rope.py)
        self.inv_freq, self.rope_scale = rope_frequencies(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        )
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.sliding_window = cfg.sliding_window
        # Set to a list by a training probe (train/copy_attention.py) to receive head 0's
        # RoPE'd query and key `([B, T, d], [B, T, d])` of every call; None records nothing.
        self.head0_probe: list | None = None

    def forward(self, x, positions, cache: LayerCache, mask) -> torch.Tensor:
        """x [B, T, in]; positions [B, T]; the new keys are appended to `cache`, then the
        queries attend to everything the cache holds under `mask`."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.inv_freq.device != positions.device:  # moved once, not copied every call
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.head0_probe is not None:
            self.head0_probe.append((q[:, 0], k[:, 0]))  # query head 0 reads KV head 0
        cache.append(k, v, positions)
        scale = 1.0 / math.sqrt(self.head_dim)
        if isinstance(mask, TTTMask):
            out = _ttt_attention(q, cache, mask, scale)
        else:
            keys, values = cache.concatenated()
            if self.sliding_window is not None and not is_block_mask(mask):
                # a BlockMask (P-EAGLE on CUDA) carries the window in its own rule
                mask = window_mask(positions, cache.positions(), self.sliding_window, mask)
            if is_block_mask(mask):
                out = flex_block_attention(q, keys, values, mask, scale, self.num_heads != self.num_kv_heads)
            else:
                if mask is None and t > 1 and keys.shape[2] > t:
                    mask = prefix_causal_mask(t, keys.shape[2], x.device)
                out = F.scaled_dot_product_attention(
                    q,
                    keys,
                    values,
                    attn_mask=mask,
                    scale=scale,
                    is_causal=mask is None and t > 1,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, mask=None) -> torch.Tensor:
    """[B, 1, Tq, Tk] bool: a query at position i sees keys at positions i - window + 1 .. i
    (vLLM's and transformers' sliding window), and-ed with `mask` when one is given (None:
    the position rule alone is the causal mask)."""
    diff = q_pos[:, None, :, None] - k_pos[:, None, None, :]
    allowed = (diff >= 0) & (diff < window)
    return allowed if mask is None else allowed & mask


def prefix_causal_mask(num_new: int, num_keys: int, device) -> torch.Tensor:
    """[1, 1, num_new, num_keys]: new query i sees every earlier key and new keys <= i."""
    q = torch.arange(num_new, device=device)[:, None] + (num_keys - num_new)
    return (torch.arange(num_keys, device=device)[None, :] <= q)[None, None]


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer. Layer 0 of a head (`first=True`) attends over
    `concat(input_layernorm(embed), hidden_norm(hid))` (width 2H, embedding first) and adds
    `hid` (or its normed value with `norm_before_residual`) back after attention."""

    def __init__(self, cfg: DraftHeadConfig, first: bool):
        super().__init__()
        h = cfg.hidden_size
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, hid, positions, cache: LayerCache, mask, embeds=None) -> torch.Tensor:
        if self.first:
            normed_hid = self.hidden_norm(hid)
            x = torch.cat([self.input_layernorm(embeds), normed_hid], dim=-1)
            residual = normed_hid if self.norm_before_residual else hid
        else:
            x = self.input_layernorm(hid)
            residual = hid
        hid = residual + self.self_attn(x, positions, cache, mask)
        return hid + self.mlp(self.post_attention_layernorm(hid))
