"""Loading frozen targets: tiny random families, and the real SmolLM2 (slow)."""

import pytest
import torch

from eyas.data.targets import TargetLoadError, attention_implementation, load_target


def test_tiny_target_loads_frozen_and_exposes_hidden_states(tiny_target_dir):
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    out = target.model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == target.num_layers + 1
    assert out.hidden_states[0].shape == (1, ids.shape[1], target.hidden_size)
    assert out.logits.shape[-1] == target.vocab_size


def test_gpt_oss_gets_eager_attention_on_cpu():
    assert attention_implementation("gpt_oss", torch.device("cpu")) == "eager"
    assert attention_implementation("llama", torch.device("cpu")) == "sdpa"
    assert attention_implementation("gpt_oss", torch.device("cpu"), "sdpa") == "sdpa"


def test_missing_local_target_is_a_clear_error(tmp_path):
    with pytest.raises(TargetLoadError, match="not found"):
        load_target(str(tmp_path / "nope"), device="cpu")


@pytest.mark.slow
def test_smollm2_alias_answers_paris():
    target = load_target("smollm2-135m", device="cpu")
    tok = target.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_dict=True, return_tensors="pt",
    )["input_ids"]
    out = target.model.generate(ids, max_new_tokens=24, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
