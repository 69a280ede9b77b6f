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

from eyas.core.acceptance import expected_tokens_per_step
from eyas.eval.sizes import Hardware, HeadSize, TargetSize
from eyas.eval.vram import format_vram_tax, vram_tax
from eyas.export.vllm_command import speculative_config as heads_speculative_config
from eyas.heads.algorithms import get_algorithm

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


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
    on the host while the target's step is prepared). The fixed terms are the head's own
    where `hw` has them (`draft_pass_overhead`, `draft_layer_latency`)."""
    if head.algorithm == "ngram":
        return 0.0
    hw = draft_hardware(hw)
    kv = batch * head.kv_bytes(context)
    wbytes = head.params * 2
    verified = 1 + (k if drafted is None else drafted)
    if get_algorithm(head.algorithm).draft_passes(k) == 1:  # parallel drafting
        n = batch * (verified + k - 1)
        return pass_time(hw, head.num_layers, wbytes, 2 * head.params * n, kv)
    first = pass_time(hw, head.num_layers, wbytes, 2 * head.params * batch * verified, kv)
    return first + (k - 1) * pass_time(hw, head.num_layers, wbytes, 2 * head.params * batch, kv)


def draft_hardware(hw: Hardware) -> Hardware:
    """`hw` with a draft head's measured fixed terms in place of the target's, where known."""
    return replace(
        hw,
        pass_overhead=hw.pass_overhead if hw.draft_pass_overhead is None else hw.draft_pass_overhead,
        layer_latency=hw.layer_latency if hw.draft_layer_latency is None else hw.draft_layer_latency,
    )


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
    drafts = draft_hardware(hw)
    lines = [
        f"hardware {hw.name}: HBM {hw.hbm_bandwidth / 1e12:.2f} TB/s x{hw.bw_efficiency}, "
        f"peak {hw.peak_flops / 1e12:.0f} TFLOP/s (dense bf16) x{hw.flops_efficiency}, "
        f"fixed {hw.pass_overhead * 1e6:.0f} us/pass + {hw.layer_latency * 1e6:.0f} us/layer"
        + (f" + {hw.step_overhead * 1e6:.0f} us/engine step" if hw.step_overhead else "")
        + (
            f"; draft passes measured: {drafts.pass_overhead * 1e6:.0f} us/pass + "
            f"{drafts.layer_latency * 1e6:.0f} us/layer"
            if drafts != hw
            else ""
        ),
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


def dumps(plans: dict) -> str:
    return json.dumps({n: p.as_dict() for n, p in plans.items()}, indent=2)
