"""The sizes the serving planner reasons over (DESIGN §6): accelerators (HBM bandwidth,
peak FLOP/s, fixed latencies, memory) and targets (published parameter counts and shapes,
MoE routing, sliding windows), by name or from a config.json / calibrated profile, and
the size of a draft head shaped like its target. The roofline itself is eval/planner.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from eyas.heads.algorithms import get_algorithm


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bandwidth: float  # bytes/s
    peak_flops: float  # dense BF16 FLOP/s
    layer_latency: float = 50e-6  # s per decoder layer per pass: kernel launches, tiny GEMM latency
    pass_overhead: float = 300e-6  # s per forward pass, the target's and each draft pass alike
    step_overhead: float = 0.0  # s per engine step however many passes: scheduling, sampling
    bw_efficiency: float = 0.8
    flops_efficiency: float = 0.3  # grouped MoE GEMMs at small per-expert batch
    memory_bytes: float = 0.0  # accelerator memory, for the VRAM tax (0: unknown)
    # A draft head's own fixed terms where they were measured (scripts/bench_draft.py; None:
    # the pass and layer terms above): a head's small passes run from CUDA graphs in the
    # engine, so their floors are not the target's.
    draft_pass_overhead: float | None = None
    draft_layer_latency: float | None = None


HARDWARE = {
    h.name: h
    for h in (
        Hardware(name="B200", hbm_bandwidth=8.0e12, peak_flops=2.25e15, memory_bytes=180e9),
        # draft terms: GPT-OSS-20B-shaped heads replayed from CUDA graphs on an H200, fitted
        # by scripts/bench_draft.py (docs/benchmarks.md, "Drafting on an H200")
        Hardware(
            name="H200",
            hbm_bandwidth=4.8e12,
            peak_flops=0.989e15,
            memory_bytes=141e9,
            draft_pass_overhead=38e-6,
            draft_layer_latency=129e-6,
        ),
        Hardware(name="H100", hbm_bandwidth=3.35e12, peak_flops=0.989e15, memory_bytes=80e9),
        Hardware(name="A100", hbm_bandwidth=2.039e12, peak_flops=0.312e15, memory_bytes=80e9),
        Hardware(name="L40S", hbm_bandwidth=0.864e12, peak_flops=0.362e15, memory_bytes=48e9),
        Hardware(name="L4", hbm_bandwidth=0.300e12, peak_flops=0.121e15, memory_bytes=24e9),
        Hardware(name="MI300X", hbm_bandwidth=5.3e12, peak_flops=1.307e15, memory_bytes=192e9),
    )
}


def load_hardware(spec: str) -> Hardware:
    """A name from HARDWARE, or a JSON profile (`eyas plan --calibrate` writes one)."""
    if spec in HARDWARE:
        return HARDWARE[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"unknown hardware {spec!r}: choose from {', '.join(HARDWARE)} or give a JSON profile file"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a JSON hardware profile ({err})") from None
    raw = raw.get("hardware", raw) if isinstance(raw, dict) else raw
    known = set(Hardware.__dataclass_fields__)
    if (
        not isinstance(raw, dict)
        or set(raw) - known
        or not {"name", "hbm_bandwidth", "peak_flops"} <= set(raw)
    ):
        raise ValueError(
            f"{path}: a hardware profile holds name, hbm_bandwidth, peak_flops and optionally "
            f"{sorted(known - {'name', 'hbm_bandwidth', 'peak_flops'})}; got keys {sorted(raw or {})}"
        )
    return Hardware(**raw)


def with_overrides(hw: Hardware, **kw) -> Hardware:
    """`hw` with the terms given (not None) replaced, e.g. a measured pass overhead."""
    return replace(hw, **{k: v for k, v in kw.items() if v is not None})


@dataclass(frozen=True)
class TargetSize:
    """Published sizes of a target. Expert params are the total in routed experts."""

    name: str
    total_params: float
    active_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int  # of a head layer shaped like the target's dense MLP
    bytes_per_param: float = 2.0
    expert_params: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_bytes_per_param: float = 2.0
    sliding_window: int | None = None
    sliding_fraction: float = 0.0  # share of layers with a sliding window

    def weight_bytes(self, tokens: float) -> float:
        """Bytes of weights a pass over `tokens` tokens reads (embedding rows ignored)."""
        dense = (self.active_params - self.expert_params * self._route_share()) * self.bytes_per_param
        if not self.num_experts:
            return dense
        touched = 1.0 - (1.0 - self._route_share()) ** tokens
        return dense + self.expert_params * touched * self.expert_bytes_per_param

    def total_weight_bytes(self) -> float:
        """Bytes of all weights held in memory (every expert)."""
        return (
            self.total_params - self.expert_params
        ) * self.bytes_per_param + self.expert_params * self.expert_bytes_per_param

    def _route_share(self) -> float:
        return self.experts_per_token / self.num_experts if self.num_experts else 0.0

    def kv_bytes(self, context: int) -> float:
        """KV cache bytes of one sequence with `context` tokens (bf16)."""
        per_layer_token = 2 * self.num_kv_heads * self.head_dim * 2
        full = (1 - self.sliding_fraction) * context
        slid = self.sliding_fraction * min(context, self.sliding_window or context)
        return self.num_layers * per_layer_token * (full + slid)

    def attention_flops(self, context: int) -> float:
        """FLOPs per new token for attention over `context` tokens."""
        eff = (1 - self.sliding_fraction) * context + self.sliding_fraction * min(
            context, self.sliding_window or context
        )
        return 4 * self.num_layers * self.num_heads * self.head_dim * eff


# The two GPT-OSS sizes share their layers' shape, MXFP4 experts and sliding windows.
_GPT_OSS = dict(
    hidden_size=2880,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    vocab_size=201088,
    intermediate_size=2880 * 3,
    experts_per_token=4,
    expert_bytes_per_param=0.53,
    sliding_window=128,
    sliding_fraction=0.5,
)

TARGETS = {
    t.name: t
    for t in (
        TargetSize(
            name="gpt-oss-20b",
            total_params=20.9e9,
            active_params=3.6e9,
            num_layers=24,
            expert_params=19.1e9,
            num_experts=32,
            **_GPT_OSS,
        ),
        TargetSize(
            name="gpt-oss-120b",
            total_params=116.8e9,
            active_params=5.1e9,
            num_layers=36,
            expert_params=114.7e9,
            num_experts=128,
            **_GPT_OSS,
        ),
        TargetSize(
            name="qwen3-coder-30b-a3b",
            total_params=30.5e9,
            active_params=3.3e9,
            num_layers=48,
            hidden_size=2048,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=151936,
            intermediate_size=6144,
            expert_params=29.0e9,
            num_experts=128,
            experts_per_token=8,
        ),
        TargetSize(
            name="llama-3.1-8b",
            total_params=8.03e9,
            active_params=8.03e9,
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=128256,
            intermediate_size=14336,
        ),
        TargetSize(
            name="smollm2-135m",
            total_params=0.135e9,
            active_params=0.135e9,
            num_layers=30,
            hidden_size=576,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            vocab_size=49152,
            intermediate_size=1536,
        ),
    )
}


def target_size_from_config(cfg: dict, name: str = "measured", bytes_per_param: float = 2.0) -> TargetSize:
    """Sizes of a Llama/Qwen-style target from its Hugging Face config.json (MoE included:
    `num_local_experts`/`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`)."""
    cfg = cfg.get("text_config", cfg)
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    inter = cfg.get("intermediate_size", 4 * h)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    per_tok = cfg.get("num_experts_per_tok", 0) if experts else 0
    attn = h * (heads + 2 * kv) * hd + heads * hd * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    if experts:
        expert_total = layers * experts * 3 * h * cfg.get("moe_intermediate_size", inter)
        dense = layers * (attn + h * experts) + embed
    else:
        expert_total, dense = 0.0, layers * (attn + 3 * h * inter) + embed
    total = dense + expert_total
    active = dense + expert_total * (per_tok / experts if experts else 0)
    window = cfg.get("sliding_window") if cfg.get("layer_types") or cfg.get("use_sliding_window") else None
    sliding = (
        (sum(t == "sliding_attention" for t in cfg.get("layer_types") or []) / layers) if window else 0.0
    )
    return TargetSize(
        name=name,
        total_params=float(total),
        active_params=float(active),
        num_layers=layers,
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hd,
        vocab_size=vocab,
        intermediate_size=inter,
        bytes_per_param=bytes_per_param,
        expert_params=float(expert_total),
        num_experts=experts,
        experts_per_token=per_tok,
        expert_bytes_per_param=bytes_per_param,
        sliding_window=window if sliding else None,
        sliding_fraction=sliding,
    )


def parse_target(spec: str) -> TargetSize:
    """A name from the table, or `key=value,...` over TargetSize's fields (name and the
    dense fields required: total_params, num_layers, hidden_size, num_heads,
    num_kv_heads, head_dim, vocab_size; active_params and intermediate_size default)."""
    key = spec.strip().lower()
    if key in TARGETS:
        return TARGETS[key]
    if "=" not in spec:
        raise ValueError(
            f"unknown target {spec!r}: choose from {sorted(TARGETS)} or give key=value,... sizes"
        )
    fields = dict(item.split("=", 1) for item in spec.split(","))
    kw: dict = {"name": fields.pop("name", "custom")}
    types = {f: t for f, t in TargetSize.__annotations__.items()}
    for f, raw in fields.items():
        if f not in types:
            raise ValueError(f"unknown target field {f!r}; fields: {sorted(types)}")
        kw[f] = int(float(raw)) if types[f] == "int" else (float(raw) if "float" in types[f] else raw)
    kw.setdefault("active_params", kw.get("total_params"))
    kw.setdefault("intermediate_size", 4 * int(kw.get("hidden_size", 0)))
    try:
        return TargetSize(**kw)
    except TypeError as err:
        raise ValueError(f"target sizes {spec!r}: {err}") from None


@dataclass(frozen=True)
class HeadSize:
    algorithm: str  # eagle3 (K chained passes) or peagle (one pass)
    num_layers: int
    params: float
    kv_per_token: float  # bytes, every layer
    sliding_window: int | None = None  # every head layer's (head.sliding_window); None: all

    def kv_bytes(self, context: int) -> float:
        """Draft KV bytes of one sequence of `context` tokens: a windowed layer keeps (and
        reads) its last `sliding_window` tokens only."""
        return self.kv_per_token * min(context, self.sliding_window or context)


def head_size(
    target: TargetSize,
    algorithm: str,
    num_layers: int | None = None,
    draft_vocab: int = 32000,
    sliding_window: int | None = None,
) -> HeadSize:
    """A head shaped like the target's decoder layers (DESIGN §3/§4): layer 0 reads 2H,
    fc from 3·Ht, lm_head over the draft vocabulary."""
    layers = num_layers or get_algorithm(algorithm).typical_num_layers
    h, q, kv = target.hidden_size, target.num_heads * target.head_dim, target.num_kv_heads * target.head_dim
    attn0 = 2 * h * (q + 2 * kv) + q * h
    attn = h * (q + 2 * kv) + q * h
    mlp = 3 * h * target.intermediate_size
    params = attn0 + mlp + (layers - 1) * (attn + mlp) + 3 * h * h + min(draft_vocab, target.vocab_size) * h
    return HeadSize(algorithm, layers, params, layers * 2 * kv * 2, sliding_window)
