"""The fake's vLLM config: it offers per-request speculative metrics, as vLLM 0.32 does,
unless $FAKE_VLLM_NO_PER_REQUEST is set (an older engine)."""

import os


class ObservabilityConfig:
    if not os.environ.get("FAKE_VLLM_NO_PER_REQUEST"):
        per_request_spec_decode_metrics = "none"
