"""eyas: train speculative-decoding draft heads (EAGLE-3, P-EAGLE) for a frozen target
LLM, evaluate them offline, and export them in the format vLLM serves as-is."""

__version__ = "0.1.0"
