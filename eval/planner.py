"""The serving planner: measured per-position acceptance + a roofline of the target and
the head -> expected speedup of speculative decoding against concurrency, per K.

Cost of one forward pass over N tokens from B sequences with context C (DESIGN §6):
    t = pass_overhead + layers * layer_latency
        + max(bytes_read / (HBM bandwidth * bw_eff), flops / (peak FLOP/s * flops_eff))
bytes_read = the weights the pass touches (for a MoE: the dense part plus the experts
that N tokens route to, 1 - (1 - e/E)^N of them in expectation) + the KV cache of the B
sequences; flops = 2 * active params * N + attention over the context. The fixed terms
model launch/latency floors, which dominate a small batch: they are why a chain of K
head passes (EAGLE-3) costs much more than one pass (P-EAGLE) at concurrency 1.
An engine step adds a fixed step_overhead (scheduling, sampling) once, however many
passes it runs. Speedup(B, K) = E_K * t_plain(B) / (t_draft(B, K) + t_verify(B, K+1)),
both sides with the step overhead, where E_K = expected_tokens_per_step(a_1..a_K)
(never 1 / (1 - aK)).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eyas.core.acceptance import expected_tokens_per_step
from eyas.eval.vram import format_vram_tax, vram_tax
from eyas.heads.algorithms import get_algorithm
from eyas.heads.serving_config import speculative_config as heads_speculative_config

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


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


HARDWARE = {
    h.name: h
    for h in (
        Hardware("B200", 8.0e12, 2.25e15, memory_bytes=180e9),
        Hardware("H200", 4.8e12, 0.989e15, memory_bytes=141e9),
        Hardware("H100", 3.35e12, 0.989e15, memory_bytes=80e9),
        Hardware("A100", 2.039e12, 0.312e15, memory_bytes=80e9),
        Hardware("L40S", 0.864e12, 0.362e15, memory_bytes=48e9),
        Hardware("L4", 0.300e12, 0.121e15, memory_bytes=24e9),
        Hardware("MI300X", 5.3e12, 1.307e15, memory_bytes=192e9),
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


TARGETS = {
    t.name: t
    for t in (
        TargetSize(
            "gpt-oss-20b",
            20.9e9,
            3.6e9,
            24,
            2880,
            64,
            8,
            64,
            201088,
            2880 * 3,
            expert_params=19.1e9,
            num_experts=32,
            experts_per_token=4,
            expert_bytes_per_param=0.53,
            sliding_window=128,
            sliding_fraction=0.5,
        ),
        TargetSize(
            "gpt-oss-120b",
            116.8e9,
            5.1e9,
            36,
            2880,
            64,
            8,
            64,
            201088,
            2880 * 3,
            expert_params=114.7e9,
            num_experts=128,
            experts_per_token=4,
            expert_bytes_per_param=0.53,
            sliding_window=128,
            sliding_fraction=0.5,
        ),
        TargetSize(
            "qwen3-coder-30b-a3b",
            30.5e9,
            3.3e9,
            48,
            2048,
            32,
            4,
            128,
            151936,
            6144,
            expert_params=29.0e9,
            num_experts=128,
            experts_per_token=8,
        ),
        TargetSize("llama-3.1-8b", 8.03e9, 8.03e9, 32, 4096, 32, 8, 128, 128256, 14336),
        TargetSize("smollm2-135m", 0.135e9, 0.135e9, 30, 576, 9, 3, 64, 49152, 1536),
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
        name,
        float(total),
        float(active),
        layers,
        h,
        heads,
        kv,
        hd,
        vocab,
        inter,
        bytes_per_param,
        float(expert_total),
        experts,
        per_tok,
        bytes_per_param,
        window if sliding else None,
        sliding,
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
    kv_per_token: float  # bytes


def head_size(
    target: TargetSize, algorithm: str, num_layers: int | None = None, draft_vocab: int = 32000
) -> HeadSize:
    """A head shaped like the target's decoder layers (DESIGN §3/§4): layer 0 reads 2H,
    fc from 3·Ht, lm_head over the draft vocabulary."""
    layers = num_layers or get_algorithm(algorithm).typical_num_layers
    h, q, kv = target.hidden_size, target.num_heads * target.head_dim, target.num_kv_heads * target.head_dim
    attn0 = 2 * h * (q + 2 * kv) + q * h
    attn = h * (q + 2 * kv) + q * h
    mlp = 3 * h * target.intermediate_size
    params = attn0 + mlp + (layers - 1) * (attn + mlp) + 3 * h * h + min(draft_vocab, target.vocab_size) * h
    return HeadSize(algorithm, layers, params, layers * 2 * kv * 2)


def pass_time(hw: Hardware, layers: int, weight_bytes: float, flops: float, kv_bytes: float) -> float:
    mem = (weight_bytes + kv_bytes) / (hw.hbm_bandwidth * hw.bw_efficiency)
    compute = flops / (hw.peak_flops * hw.flops_efficiency)
    return hw.pass_overhead + layers * hw.layer_latency + max(mem, compute)


def target_time(hw: Hardware, t: TargetSize, batch: float, tokens_per_seq: float, context: int) -> float:
    n = batch * tokens_per_seq
    return pass_time(
        hw,
        t.num_layers,
        t.weight_bytes(n),
        n * (2 * t.active_params + t.attention_flops(context)),
        batch * t.kv_bytes(context),
    )


def draft_time(
    hw: Hardware, head: HeadSize, batch: float, k: int, context: int, drafted: float | None = None
) -> float:
    """The head's passes in one step. The first pass reads every token the target just
    verified (1 + `drafted` per sequence, rejected ones included: vLLM pads the drafter's
    batch rather than compacting it); EAGLE-3 then runs K-1 one-token passes, P-EAGLE
    appends its K-1 mask slots to the first pass instead. n-gram: no pass (its lookup runs
    on the host while the target's step is prepared)."""
    if head.algorithm == "ngram":
        return 0.0
    kv = batch * head.kv_per_token * context
    wbytes = head.params * 2
    verified = 1 + (k if drafted is None else drafted)
    if get_algorithm(head.algorithm).draft_passes(k) == 1:  # parallel drafting
        n = batch * (verified + k - 1)
        return pass_time(hw, head.num_layers, wbytes, 2 * head.params * n, kv)
    first = pass_time(hw, head.num_layers, wbytes, 2 * head.params * batch * verified, kv)
    return first + (k - 1) * pass_time(hw, head.num_layers, wbytes, 2 * head.params * batch, kv)


def step_time(
    hw: Hardware,
    target: TargetSize,
    head: HeadSize | None,
    batch: float,
    context: int,
    k: int = 0,
    drafted: float | None = None,
    prefill: float = 0.0,
) -> float:
    """One engine step of `batch` sequences: the step overhead, the draft passes (`head`
    None: plain decoding) and the target's pass over each sequence's 1 + `drafted` tokens
    (default K: a head always drafts K; an n-gram drafter only after a match) plus
    `prefill` prompt tokens per sequence that the step carries (the engine mixes prompt
    chunks into decode steps)."""
    tokens = 1 + (k if drafted is None else drafted) + prefill if head is not None else 1 + prefill
    draft = draft_time(hw, head, batch, k, context, drafted) if head is not None else 0.0
    return hw.step_overhead + draft + target_time(hw, target, batch, tokens, context)


def _parallel(algorithm: str) -> bool:
    return algorithm != "ngram" and get_algorithm(algorithm).parallel_drafting


def extend_rates(rates: list[float], k: int) -> list[float]:
    """Acceptance for positions 1..k; positions past the measured ones repeat the last."""
    if not rates:
        raise ValueError("no per-position acceptance given")
    return [rates[min(i, len(rates) - 1)] for i in range(k)]


@dataclass
class Plan:
    hardware: Hardware
    target: TargetSize
    head: HeadSize
    acceptance: list[float]
    context: int
    concurrency: list[int]
    ks: list[int]
    speedup: dict = field(default_factory=dict)  # {concurrency: {k: speedup}}
    best_k: dict = field(default_factory=dict)
    breakeven_concurrency: int | None = None  # smallest concurrency where no K pays
    vram: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "hardware": asdict(self.hardware),
            "target": asdict(self.target),
            "head": asdict(self.head),
            "acceptance": self.acceptance,
            "context": self.context,
            "expected_tokens_per_step": {k: expected_tokens_per_step(self.acceptance[:k]) for k in self.ks},
            "speedup": self.speedup,
            "best_k": self.best_k,
            "breakeven_concurrency": self.breakeven_concurrency,
            "vram_tax": self.vram,
        }


def plan(
    acceptance: list[float],
    hw: Hardware,
    target: TargetSize,
    head: HeadSize,
    context: int = 2048,
    concurrency=CONCURRENCY,
    max_k: int = 8,
) -> Plan:
    ks = list(range(1, max_k + 1))
    rates = extend_rates(list(acceptance), max_k)
    p = Plan(hw, target, head, rates, context, list(concurrency), ks)
    p.vram = vram_tax(hw, target, head, context)
    for b in concurrency:
        plain = step_time(hw, target, None, b, context)
        row = {}
        for k in ks:
            e = expected_tokens_per_step(rates[:k])
            row[k] = e * plain / step_time(hw, target, head, b, context, k=k)
        p.speedup[b] = row
        best = max(row, key=row.get)
        p.best_k[b] = best
        if row[best] <= 1.0 and p.breakeven_concurrency is None:
            p.breakeven_concurrency = b
    return p


def speculative_config(plan_: Plan, concurrency: int, model: str) -> dict:
    """The vLLM `--speculative-config` for the best K at `concurrency` (DESIGN §5)."""
    return heads_speculative_config(plan_.head.algorithm, model, plan_.best_k[concurrency])


def assumptions(p: Plan) -> list[str]:
    hw, t, h = p.hardware, p.target, p.head
    lines = [
        f"hardware {hw.name}: HBM {hw.hbm_bandwidth / 1e12:.2f} TB/s x{hw.bw_efficiency}, "
        f"peak {hw.peak_flops / 1e12:.0f} TFLOP/s (dense bf16) x{hw.flops_efficiency}, "
        f"fixed {hw.pass_overhead * 1e6:.0f} us/pass + {hw.layer_latency * 1e6:.0f} us/layer"
        + (f" + {hw.step_overhead * 1e6:.0f} us/engine step" if hw.step_overhead else ""),
        f"target {t.name}: {t.total_params / 1e9:.2f}B params ({t.active_params / 1e9:.2f}B active), "
        f"{t.num_layers} layers, weights read per token {t.weight_bytes(1) / 1e9:.2f} GB, "
        f"KV {t.kv_bytes(p.context) / 1e6:.1f} MB per sequence at context {p.context}",
        f"head {h.algorithm}: {h.num_layers} layer(s), {h.params / 1e6:.0f}M params (bf16); "
        + ("one draft pass for all K" if _parallel(h.algorithm) else "K chained draft passes"),
        "acceptance a_k: "
        + ", ".join(f"{a:.3f}" for a in p.acceptance)
        + " (positions past the measured ones repeat the last measured rate)",
        "E_K = 1 + sum_k prod_{j<=k} a_j; speedup = E_K * t_plain / (t_step + t_draft + t_verify(K+1))",
        format_vram_tax(p.vram),
    ]
    return lines


def format_plan(p: Plan) -> str:
    head = ["conc"] + [f"K={k}" for k in p.ks] + ["best K"]
    rows = [head] + [
        [str(b)] + [f"{p.speedup[b][k]:.2f}" for k in p.ks] + [str(p.best_k[b])] for b in p.concurrency
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    table = "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
    off = (
        f"speculation stops paying at concurrency >= {p.breakeven_concurrency}"
        if p.breakeven_concurrency
        else f"speculation pays at every concurrency up to {p.concurrency[-1]}"
    )
    return table + "\n" + off


def plot_plans(plans: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, p in plans.items():
        best = [p.speedup[b][p.best_k[b]] for b in p.concurrency]
        ax.plot(p.concurrency, best, marker="o", label=f"{name} (best K)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup over plain decoding")
    first = next(iter(plans.values()))
    ax.set_title(f"{first.target.name} on {first.hardware.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def with_overrides(hw: Hardware, **kw) -> Hardware:
    return replace(hw, **{k: v for k, v in kw.items() if v is not None})


def dumps(plans: dict) -> str:
    return json.dumps({n: p.as_dict() for n, p in plans.items()}, indent=2)
