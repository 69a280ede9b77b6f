"""The speculative-decoding counters of a vLLM engine, read from its Prometheus `/metrics`
(DESIGN §6.2): drafts, draft tokens, accepted tokens and accepted tokens per position,
summed over the engine's processes; a level's numbers are the difference of two readings.
"""

from __future__ import annotations

import urllib.request

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def read_counters(base_url: str) -> dict:
    """Speculative-decoding counters of the engine's Prometheus endpoint, summed over engines."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode("utf-8", "replace")
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += float(value)
        elif name == PER_POSITION:
            pos = int(name_labels.split('position="', 1)[1].split('"', 1)[0])
            out["per_position"][pos] = out["per_position"].get(pos, 0.0) + float(value)
    return out


def counter_delta(before: dict, after: dict) -> dict:
    positions = sorted(set(before["per_position"]) | set(after["per_position"]))
    return {
        "drafts": after["drafts"] - before["drafts"],
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "accepted": after["accepted"] - before["accepted"],
        "per_position": [
            after["per_position"].get(p, 0.0) - before["per_position"].get(p, 0.0) for p in positions
        ],
    }
