"""RoPE scaling in the head (heads/rope.py): the head rotates as transformers rotates the
target (llama3, yarn, linear), a head built for a scaled target or imported with a
scaling keeps it through training and export, and a scaling the head cannot apply is
refused naming its key."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.tiny_heads import tiny_head_config

from eyas.heads.config import DraftHeadConfig, head_config_from_target
from eyas.heads.layers import Attention, LayerCache
from eyas.heads.rope import RopeScalingError

LLAMA3 = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 64,
    "rope_type": "llama3",
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
}
LINEAR = {"rope_type": "linear", "factor": 2.0}


def _head_config(scaling: dict | None, theta: float = 10000.0) -> DraftHeadConfig:
    return tiny_head_config(rope_theta=theta, rope_scaling=scaling, max_position_embeddings=512)


def _reference_attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor, scaling, theta):
    """The same projections rotated by transformers' LlamaRotaryEmbedding for a Llama
    config of that scaling, then dense causal softmax attention written out."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": theta, **(scaling or {})},
    )
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, 4, 16).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, 2, 16).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, 2, 16).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, 64))


@pytest.mark.parametrize("scaling", [LLAMA3, YARN, LINEAR, None], ids=["llama3", "yarn", "linear", "plain"])
def test_head_attention_rotates_as_transformers_does(scaling):
    torch.manual_seed(0)
    theta = 500000.0
    attn = Attention(_head_config(scaling, theta), 64).float()
    x = torch.randn(2, 40, 64)
    # far positions, past the original context, where the scalings differ most
    positions = torch.arange(300, 340)[None].expand(2, -1)
    ours = attn(x, positions, LayerCache(), None)
    ref = _reference_attention(attn, x, positions, scaling, theta)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    if scaling is not None:  # the scaling changes what the head computes
        plain = _reference_attention(attn, x, positions, None, theta)
        assert (ours - plain).abs().max() > 1e-3


@pytest.mark.parametrize(
    "scaling, words",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type 'dynamic' is not supported"),
        ({"rope_type": "su", "factor": 2.0}, "rope_scaling.rope_type 'su' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ],
)
def test_a_scaling_the_head_cannot_apply_is_refused_naming_the_key(scaling, words):
    with pytest.raises((RopeScalingError, ValueError), match="rope_scaling") as err:
        _head_config(scaling)
    assert words in str(err.value)


def test_a_scaled_target_gives_its_scaling_to_the_head_and_the_export(tmp_path):
    from transformers import LlamaConfig

    from eyas.export.reader import load_any_head
    from eyas.export.writer import export_head
    from eyas.heads.algorithms import build_head

    target = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=8,
        vocab_size=320,
        max_position_embeddings=512,
        rope_scaling=dict(LLAMA3),
        rope_theta=500000.0,
    )
    cfg = head_config_from_target(
        target, aux_layer_ids=[1, 4, 5], draft_vocab_size=320, verifier_name_or_path="org/target"
    )
    assert cfg.rope_scaling == LLAMA3 and cfg.rope_theta == 500000.0
    head = build_head(cfg)
    out = export_head(head, tmp_path / "export", verifier="org/target")
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["rope_scaling"] == LLAMA3
    assert layer["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}
    back = load_any_head(out, target_embed=torch.zeros(320, 64))
    assert back.config.rope_scaling == LLAMA3
    attn = back.layers[0].self_attn
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.testing.assert_close(attn.inv_freq, LlamaRotaryEmbedding(target).inv_freq)


def test_a_published_head_with_llama3_scaling_keeps_it_through_training_and_export(tmp_path, tiny_llama_dir):
    """Import a published EAGLE-3 head whose config has llama3 rope_scaling
    (tests/support/fixtures/published_heads/eagle_llama3_8b_duplicate_key, scaled to the tiny
    target), train it 3 steps with train.init_from, export: the scaling is the published one."""
    from safetensors.torch import save_file
    from support.published_heads import producer_tensors, scaled_config
    from support.train_run_fixtures import prepare_run

    from eyas.export.writer import export_checkpoint
    from eyas.heads.io import load_head
    from eyas.recipe import recipe_from_dict
    from eyas.train.loop import train

    raw = scaled_config("eagle_llama3_8b_duplicate_key")
    published = dict(raw["rope_scaling"])
    assert published["rope_type"] == "llama3"
    src = tmp_path / "published"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(raw))
    save_file(producer_tensors(raw, "eagle"), str(src / "model.safetensors"))

    recipe = prepare_run(tmp_path / "run", tiny_llama_dir, init_from=str(src), max_steps=3)
    tree = recipe.model_dump(mode="json", exclude_unset=True)
    tree["head"] = {}  # the published head's shape and vocabulary win
    summary = train(recipe_from_dict(tree), progress=False)
    assert summary["step"] == 3
    tuned = load_head(summary["final_dir"], torch.zeros(320, 64))
    assert tuned.config.rope_scaling == published
    out = export_checkpoint(summary["final_dir"], tmp_path / "export", fmt="eagle", verifier="org/tiny")
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_scaling"] == published
    assert exported["rope_theta"] == raw.get("rope_theta", 10000.0)
    assert exported["max_position_embeddings"] == raw["max_position_embeddings"]
