import os

import pytest

# Tests never reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests keep eyas's per-machine files in a cache of their own (tests/ under the user's):
# the timing verdicts their tiny shapes leave stay out of the user's, while the SmolLM2
# conversion and the tokenizers built from ranks are made once per machine, not per session.
if "EYAS_CACHE_DIR" not in os.environ:
    from eyas.core.cache_dir import eyas_cache_dir

    os.environ["EYAS_CACHE_DIR"] = str(eyas_cache_dir() / "tests")

# tests/ has no __init__.py: pytest puts this folder on sys.path, so what the tests share is
# imported as `support.<module>` from any stage folder; a test file's basename stays unique.
import sys  # noqa: E402

from support.tiny_targets import FAMILIES, save_tiny_target  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """A training run in this process leaves its mixed precision in accelerate's
    process-wide state, which the next run with another precision may not change."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_target_dir(request, tmp_path_factory):
    """A saved tiny target of each family (Llama, Qwen3-MoE, GPT-OSS)."""
    return save_tiny_target(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_target("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from support.tiny_targets import byte_tokenizer

    return byte_tokenizer()
