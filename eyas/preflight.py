"""Preflight (DESIGN §2.9): whether a recipe fits the GPUs it will run on, per stage and
per rank, before anything loads. From the target's config.json built on the meta device
(target/shapes.py) and the recipe: the target's weights as they load (quantized or not),
its forward's activations at the micro-batch with the attention kernel that will run,
the head with its optimizer state and TTT / COD activations, the LM-head chunks, the
feature cache on disk and the regeneration engine's layout and KV room; then the time
per stage from FLOPs and bandwidth with the planner's hardware profiles (eval/sizes.py).

The memory model is an estimate of the peak, not a measurement: its constants are named
below with what they stand for; a GPU run that measures the peak corrects them.
"""

from __future__ import annotations

import math

from eyas.eval.sizes import (
    HARDWARE,
    Hardware,
    head_size,
    load_hardware,
    target_size_from_config,
    with_overrides,
)
from eyas.preflight_engine import (
    beside_the_engine,
    capture_engine_stage,
    capture_seconds,
    regenerate_stage,
)
from eyas.preflight_plan import CONTEXT_BYTES, FRAGMENTATION, GB, Preflight, StagePlan

# Bytes per token and hidden unit a transformer layer keeps for backward in bf16 with a
# fused attention (the 34·s·b·h of Korthikanti et al., 2022), and per draft-vocabulary
# logit and TTT step (bf16 logits + their float32 log-softmax).
LAYER_ACTIVATION_BYTES = 34
LOGIT_BYTES = 6
# Bytes per head parameter under mixed precision: float32 weights, gradients, AdamW's two
# moments, Muon's one momentum buffer (train.optimizer=muon: the hidden matrices only).
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES, MUON_BYTES = 4, 4, 8, 4
LM_HEAD_CHUNK_TOKENS = 4096  # train/losses.py target_labels' chunk
STRATEGIES = ("ddp", "zero2", "fsdp", "zero3")


def parse_gpu(spec: str) -> Hardware:
    """`H200`, `H100-80`, `A100-40`: a planner profile, with its memory in GB after the dash."""
    name, _, mem = spec.partition("-")
    try:
        hw = load_hardware(name)
    except ValueError:
        raise ValueError(
            f"unknown GPU {spec!r}: choose from {', '.join(HARDWARE)} (NAME-GB sets the memory)"
        ) from None
    if mem:
        if not mem.isdigit():
            raise ValueError(f"GPU {spec!r}: the memory after the dash is a number of GB")
        hw = with_overrides(hw, memory_bytes=float(mem) * GB, name=spec)
    return hw


def _forward_bytes(size, shape, tokens: int, seq: int, attention: str, unit: int) -> dict[str, float]:
    """The frozen target's forward peak over `tokens` tokens in sequences of `seq` (no grad):
    one layer's transients, the attention scores when the kernel materialises them."""
    h, inter = size.hidden_size, size.intermediate_size
    cfg = shape.config
    if size.num_experts:
        inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", inter)
        mlp = tokens * size.experts_per_token * 3 * inter * unit  # routed copies, gate/up, act
    else:
        mlp = tokens * 3 * inter * unit
    layer = tokens * h * unit * 6 + tokens * size.num_heads * size.head_dim * unit * 4
    out = {"target forward (one layer's transients)": layer + mlp}
    if attention == "eager":  # scores, with the sinks column, and probabilities: [n, heads, seq, seq]
        out["target attention scores (eager)"] = 3 * tokens * seq * size.num_heads * unit
    return out


def _head_bytes(recipe, size, tokens: int, world: int, strategy: str) -> tuple[dict[str, float], float]:
    """The head: its training state (sharded per strategy) and its activations -> (bytes, params)."""
    alg = recipe.head.algorithm
    hd = recipe.head.hidden_size or size.hidden_size
    vd = min(recipe.head.draft_vocab_size, size.vocab_size)
    params = head_size(size, alg, recipe.head.num_layers, vd).params
    lm_head = vd * size.hidden_size
    state = params * GRAD_BYTES + _optimizer_bytes(recipe.train.optimizer, params, lm_head)
    weights = params * PARAM_BYTES
    if strategy in ("zero2",):
        state /= world
    elif strategy in ("fsdp", "zero3"):
        state, weights = state / world, weights / world
    out = {
        "head weights (float32)": weights,
        f"head gradients + {_OPTIMIZER_NAMES[recipe.train.optimizer]} state": state,
        "head frozen embedding": size.vocab_size * size.hidden_size * PARAM_BYTES,
    }
    sec = recipe.train.section(alg)
    out[sec.ACTIVATIONS] = (
        sec.activation_copies()
        * tokens
        * (LAYER_ACTIVATION_BYTES * hd * recipe.head.num_layers + LOGIT_BYTES * vd)
    )
    return out, params


_OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon + AdamW"}


def _optimizer_bytes(optimizer: str, params: float, lm_head: float) -> float:
    """The optimizer's state over the head's `params`: under Muon the LM head (and the
    norms, too small to count) stays with AdamW (train/optimizers.py), every other matrix
    keeps Muon's single buffer."""
    if optimizer == "muon":
        return lm_head * ADAM_BYTES + (params - lm_head) * MUON_BYTES
    return params * ADAM_BYTES


def _micro_batch_tokens(recipe) -> tuple[int, int]:
    """(tokens of the largest micro-batch, its longest sequence): a sample longer than
    batch_tokens gets a batch of its own (train/batching.py)."""
    m = recipe.train.pad_to_multiple_of
    seq = math.ceil(recipe.data.max_length / m) * m
    return max(recipe.train.batch_tokens, seq), seq


def preflight(
    recipe,
    gpu: str = "H100-80",
    gpus: int = 8,
    nodes: int = 1,
    strategy: str = "ddp",
    recipe_name: str = "",
) -> Preflight:
    """Size every GPU stage of `recipe` on `nodes` × `gpus` GPUs of kind `gpu`."""
    from eyas.target.load import attention_implementation
    from eyas.target.shapes import target_shape

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose from {', '.join(STRATEGIES)}")
    hw = parse_gpu(gpu)
    t = recipe.target
    shape = target_shape(t.name_or_path, t.revision, t.trust_remote_code)
    size = target_size_from_config(shape.config, shape.name)
    attention = _attention_on_gpu(shape, t.attn_implementation, attention_implementation)
    dtype = "bfloat16" if t.dtype == "auto" else t.dtype
    unit = 4 if dtype == "float32" else 2
    dequantize = getattr(t, "dequantize", False)
    target_weights = shape.weight_bytes(dtype, dequantize)
    kept = shape.quant_method in ("mxfp4", "fp8") and not dequantize
    weights_line = (
        f"{target_weights / GB:.1f} GB per copy ("
        + (f"{shape.quant_method} experts kept quantized" if kept else dtype)
        + f", {shape.total_params / 1e9:.1f} B parameters)"
    )
    budget = hw.memory_bytes * (1 - FRAGMENTATION) - CONTEXT_BYTES
    world = gpus * nodes
    stages = []
    n_aux = len(recipe.data.aux_layer_ids or (0, 0, 0)) + 1  # + the last layer
    rg = recipe.data.regenerate
    if rg.enabled:
        stages.append(regenerate_stage(recipe, hw, size, target_weights, budget, gpus, unit))
    tokens, seq = _micro_batch_tokens(recipe)
    forward = _forward_bytes(size, shape, tokens, seq, attention, unit)
    features = recipe.data.features
    if features == "engine" or (features == "offline" and recipe.data.capture.backend == "vllm"):
        name = "engine" if features == "engine" else "capture"
        stages.append(capture_engine_stage(recipe, hw, size, target_weights, gpus, unit, n_aux, name))
    elif recipe.data.features == "offline":
        ctoks = max(recipe.data.capture_batch_tokens, seq)
        per = {"target weights": target_weights, **_forward_bytes(size, shape, ctoks, seq, attention, unit)}
        per["captured states"] = n_aux * ctoks * size.hidden_size * unit
        cap = StagePlan("capture", per, budget, capture_seconds(hw, size, world), notes=[])
        if not cap.fits:
            cap.knob = "data.capture_batch_tokens (lower), or a GPU with more memory"
        stages.append(cap)
    train = {}
    if recipe.data.features == "online":
        train["target weights"] = target_weights
        train.update(forward)
    train["aux states (3 layers + last)"] = n_aux * tokens * size.hidden_size * unit
    vd = min(recipe.head.draft_vocab_size, size.vocab_size)
    train["LM-head chunk"] = LM_HEAD_CHUNK_TOKENS * size.vocab_size * unit
    train["target labels (draft vocabulary, float32)"] = tokens * vd * 4
    head, params = _head_bytes(recipe, size, tokens, world, strategy)
    train.update(head)
    online = recipe.data.features == "online"
    st = StagePlan(
        "train", train, budget, _train_seconds(recipe, hw, size, params, tokens, seq, world, online)
    )
    st.notes.append(
        f"micro-batch {tokens} tokens (longest sequence {seq}), head {params / 1e9:.2f} B parameters"
    )
    if features == "engine":
        beside_the_engine(recipe, st, hw, n_aux * tokens * size.hidden_size * unit)
    if not st.fits and not st.knob:  # the engine's share, where it took the room, named first
        st.knob = _train_knob(recipe, st, strategy, world, tokens)
    stages.append(st)
    disk = {}
    if recipe.data.features == "offline":
        per_tok = n_aux * size.hidden_size * (1 if recipe.data.cache_dtype == "fp8" else 2)
        disk["feature cache bytes per million tokens"] = per_tok * 1e6
    return Preflight(recipe_name, hw.name, gpus, nodes, strategy, attention, weights_line, stages, disk)


def _attention_on_gpu(shape, requested, choose) -> str:
    from transformers import AutoConfig

    return choose(AutoConfig.for_model(**shape.config), requested, "cuda")


def _train_seconds(recipe, hw, size, params, tokens, seq, world, online) -> float:
    """Seconds per million trained tokens on the whole job: FLOPs over the GPUs' compute."""
    alg = recipe.head.algorithm
    sec = recipe.train.section(alg)
    passes = getattr(sec, "ttt_steps", None) or getattr(sec, "num_depths", 1)
    flops = 6 * params * passes + (2 * size.active_params + size.attention_flops(seq // 2) if online else 0)
    return 1e6 * flops / (hw.peak_flops * hw.flops_efficiency * world)


def _train_knob(recipe, st: StagePlan, strategy: str, world: int, tokens: int) -> str:
    fixed = sum(v for k, v in st.per_rank.items() if k.startswith(("target weights", "head ", "LM-head")))
    weights = st.per_rank.get("target weights", 0.0)
    if weights > st.budget:
        more = " or keep it quantized (target.dequantize: false)" if recipe.target.dequantize else ""
        return (
            f"the target's weights alone ({weights / GB:.1f} GB) exceed a GPU's "
            f"{st.budget / GB:.1f} GB: GPUs with more memory{more}"
        )
    if fixed > st.budget:
        return (
            "the target's weights and the head's state exceed a GPU: FSDP / ZeRO-3 for the head, "
            "or GPUs with more memory"
        )
    scalable = st.peak - fixed
    m = recipe.train.pad_to_multiple_of
    fit_tokens = (int(tokens * (st.budget - fixed) / scalable) // m * m) if scalable > 0 else tokens
    knobs = []
    head_state = sum(v for k, v in st.per_rank.items() if k.startswith(("head weights", "head gradients")))
    if strategy in ("ddp", "zero2") and world > 1 and head_state * (1 - 1 / world) >= st.peak - st.budget:
        knobs.append("FSDP / ZeRO-3 for the head (recipes/accelerate/fsdp.yaml)")
    if fit_tokens >= 256:
        knobs.append(
            f"train.batch_tokens and data.max_length at most {fit_tokens} (now {tokens}; "
            "grad_accum keeps the batch; data.regenerate.max_new_tokens below max_length)"
        )
    knobs.append("a GPU with more memory")
    return "; or ".join(knobs)
