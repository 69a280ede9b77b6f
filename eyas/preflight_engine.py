"""Preflight's engine stages (DESIGN §2.9): a vLLM engine eyas launches to regenerate
replies or hand over hidden states, laid out over TP × DP from its launch line, with its
weights per GPU, workspace and KV room; and the training ranks' share of the GPUs beside
an engine that feeds them; the target's forward time per captured token. eyas/preflight.py
sizes the rest and calls these.
"""

from __future__ import annotations

import math
import shlex

from eyas.eval.sizes import with_overrides
from eyas.preflight_plan import CONTEXT_BYTES, FRAGMENTATION, GB, StagePlan

# vLLM: weights and KV room share gpu_memory_utilization of each GPU; its activations and
# CUDA graphs take about this much of it.
ENGINE_WORKSPACE_BYTES = 4.0e9


def launch_layout(launch: str | None, gpus: int) -> dict:
    """TP, DP, max model length and memory share of a `vllm serve` launch line."""

    def flag(name, default):
        words = shlex.split(launch or "")
        for i, w in enumerate(words):
            if w == name and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(name + "="):
                return w.split("=", 1)[1]
        return default

    tp = int(flag("--tensor-parallel-size", flag("-tp", 1)))
    dp = int(flag("--data-parallel-size", flag("-dp", 1)))
    return {
        "tp": tp,
        "dp": dp,
        "max_model_len": int(flag("--max-model-len", 0)) or None,
        "utilization": float(flag("--gpu-memory-utilization", 0.9)),
        "gpus": tp * dp if launch else gpus,
    }


def regenerate_stage(recipe, hw, size, weights, budget, gpus, unit) -> StagePlan:
    rg, max_length = recipe.data.regenerate, recipe.data.max_length
    if rg.backend == "hf":
        kv = rg.batch_size * size.kv_bytes(max_length)
        per = {"target weights": weights, "KV cache": kv, "logits": rg.batch_size * size.vocab_size * 4}
        st = StagePlan("regenerate", per, budget, None, notes=["hf backend: one process, one GPU"])
        if not st.fits:
            st.knob = "data.regenerate.batch_size (lower), or backend: server with tensor parallelism"
        return st
    lay = launch_layout(rg.launch, gpus)
    tp, dp = lay["tp"], lay["dp"]
    share = hw.memory_bytes * lay["utilization"]
    kv_room = share - weights / tp - ENGINE_WORKSPACE_BYTES
    per = {"target weights / TP": weights / tp, "engine workspace": ENGINE_WORKSPACE_BYTES}
    st = StagePlan("regenerate", per, share, None)
    if not rg.launch:
        st.notes.append("no launch: the engine runs elsewhere (server_urls); its layout is not checked")
        st.per_rank = {}
        return st
    seqs = max(0, int(kv_room * tp // size.kv_bytes(max_length)))
    st.notes.append(
        f"engine TP {tp} x DP {dp} = {tp * dp} GPUs; KV room {kv_room / GB:.1f} GB per GPU holds {seqs} "
        f"sequences of {max_length} tokens per replica; concurrency {rg.concurrency} -> "
        f"{math.ceil(rg.concurrency / dp)} per replica"
    )
    batch = max(1, min(seqs, math.ceil(rg.concurrency / dp)))
    from eyas.eval.planner import target_time

    fast = with_overrides(hw, hbm_bandwidth=hw.hbm_bandwidth * tp, peak_flops=hw.peak_flops * tp)
    step = target_time(fast, size, batch, 1, max_length // 2)
    st.seconds_per_mtok = 1e6 / (batch * dp / step)
    _engine_problem(st, lay, gpus, seqs, max_length, "data.regenerate.launch")
    return st


def _engine_problem(st: StagePlan, lay: dict, gpus: int, seqs: int, max_length: int, setting: str) -> None:
    """What keeps a launched engine from serving: too few GPUs, no room for one sequence,
    a max model length below data.max_length."""
    tp, dp = lay["tp"], lay["dp"]
    if tp * dp > gpus:
        st.problem = f"the engine needs TP {tp} x DP {dp} = {tp * dp} GPUs, the node has {gpus}"
        st.knob = f"--tensor-parallel-size / --data-parallel-size in {setting}"
    elif seqs < 1:  # vLLM refuses to start without KV room for one sequence
        st.problem = f"no KV room for one sequence of {max_length} tokens beside the weights"
        st.knob = f"--tensor-parallel-size (raise) in {setting}, or a GPU with more memory"
    elif lay["max_model_len"] and lay["max_model_len"] < max_length:
        st.problem = f"--max-model-len {lay['max_model_len']} is below data.max_length {max_length}"
        st.knob = f"--max-model-len in {setting} (at least data.max_length)"


def capture_engine_stage(recipe, hw, size, weights, gpus, unit, n_states, name) -> StagePlan:
    """A vLLM engine's states (data.capture.backend vllm, data.features engine; DESIGN §2.3):
    it holds the target split over TP, eyas's process none of it. A sequence in flight
    takes its KV (over TP) and its states (aux and last, whole per rank) in its cache."""
    c, max_length = recipe.data.capture, recipe.data.max_length
    lay = launch_layout(c.launch, gpus)
    tp, dp = lay["tp"], lay["dp"]
    share = hw.memory_bytes * lay["utilization"]
    per = {"target weights / TP": weights / tp, "engine workspace": ENGINE_WORKSPACE_BYTES}
    st = StagePlan(name, per, share, capture_seconds(hw, size, tp * dp))
    if not c.launch:
        st.notes.append("vllm backend without launch: the engine runs elsewhere or on the CPU; not checked")
        st.per_rank = {}
        return st
    seq_bytes = size.kv_bytes(max_length) / tp + n_states * max_length * size.hidden_size * unit
    room = share - weights / tp - ENGINE_WORKSPACE_BYTES
    seqs = max(0, int(room // seq_bytes))
    in_flight = min(max(seqs, 1), math.ceil(c.concurrency / dp))
    per[f"KV + states of {in_flight} sequences of {max_length} tokens"] = in_flight * seq_bytes
    st.notes.append(
        f"vllm backend: engine TP {tp} x DP {dp}; room for {seqs} sequences per replica, "
        f"concurrency {c.concurrency}; no target copy in eyas's process"
    )
    _engine_problem(st, lay, gpus, seqs, max_length, "data.capture.launch")
    return st


def beside_the_engine(recipe, st: StagePlan, hw, states_bytes: float) -> None:
    """data.features=engine: no target copy per rank; an engine eyas launches takes its
    --gpu-memory-utilization of the ranks' GPUs while they train."""
    c = recipe.data.capture
    ahead = f"{c.prefetch_batches} batches ahead: {c.prefetch_batches * states_bytes / GB:.2f} GB"
    st.notes.append(f"data.features=engine: no target copy per rank; {ahead} of host memory per rank")
    if c.launch:
        share = launch_layout(c.launch, 0)["utilization"]
        st.budget = hw.memory_bytes * (1 - share) * (1 - FRAGMENTATION) - CONTEXT_BYTES
        st.notes.append(f"the engine (data.capture.launch) holds {share:.0%} of each GPU beside the ranks")
        if not st.fits:
            st.knob = "the engine on other GPUs (data.capture.server_url), or less --gpu-memory-utilization"


def capture_seconds(hw, size, world) -> float:
    """Seconds per million captured tokens on `world` GPUs: the target's forward FLOPs."""
    return 1e6 * 2 * size.active_params / (hw.peak_flops * hw.flops_efficiency * world)
