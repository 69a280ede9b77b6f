"""The VRAM tax of a draft head (DESIGN §6.1): what serving it costs in accelerator memory,
and how many fewer sequences fit beside the target."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eyas.eval.sizes import Hardware, HeadSize, TargetSize


def vram_tax(
    hw: Hardware, target: TargetSize, head: HeadSize, context: int, memory_utilization: float = 0.9
) -> dict:
    """What the head costs in accelerator memory: its weights (bf16), its KV cache per token
    and per sequence (a windowed head's holds min(context, window) tokens per layer), and how
    many fewer sequences of `context` tokens fit in the KV budget left after the target's
    weights (`memory_utilization` of the device, vLLM's default)."""
    head_bytes = head.params * 2
    target_kv = target.kv_bytes(context)
    head_kv = head.kv_bytes(context)
    out = {
        "head_weight_bytes": head_bytes,
        "draft_kv_bytes_per_token": head.kv_per_token,
        "draft_kv_bytes_per_sequence": head_kv,
        "draft_sliding_window": head.sliding_window,
        "target_kv_bytes_per_sequence": target_kv,
        "target_weight_bytes": target.total_weight_bytes(),
        "context": context,
    }
    if hw.memory_bytes:
        budget = hw.memory_bytes * memory_utilization - target.total_weight_bytes()
        plain = max(0, int(budget // target_kv))
        spec = max(0, int((budget - head_bytes) // (target_kv + head_kv)))
        out.update(
            kv_budget_bytes=budget,
            sequences_plain=plain,
            sequences_with_head=spec,
            fewer_sequences=plain - spec,
            fewer_fraction=(plain - spec) / plain if plain else None,
        )
    return out


def format_vram_tax(tax: dict) -> str:
    window = tax.get("draft_sliding_window")
    line = (
        f"VRAM tax: head {tax['head_weight_bytes'] / 1e9:.2f} GB, draft KV "
        f"{tax['draft_kv_bytes_per_token'] / 1e3:.1f} "
        f"KB/token ({tax['draft_kv_bytes_per_sequence'] / 1e6:.1f} MB per sequence at {tax['context']} "
        f"tokens{f' (window {window})' if window else ''}, "
        f"target {tax['target_kv_bytes_per_sequence'] / 1e6:.1f} MB)"
    )
    if "sequences_plain" in tax:
        frac = tax["fewer_fraction"]
        line += (
            f"; {tax['sequences_plain']} sequences fit plain, {tax['sequences_with_head']} with the head "
            f"({tax['fewer_sequences']} fewer" + (f", {frac:.1%})" if frac is not None else ")")
        )
    return line
