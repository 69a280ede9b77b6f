"""Export → validate → load back gives the same head (DESIGN §5), in both layouts."""

import json

import pytest
import torch
from safetensors.torch import load_file
from support.tiny_heads import random_head, step_logits

from eyas.export.reader import detect_format, load_any_head
from eyas.export.validate import validate_export
from eyas.export.writer import export_checkpoint, export_head, serve_command
from eyas.heads.io import save_head
from eyas.heads.peagle import PEagleHead

VARIANTS = {
    "eagle3": {},
    "eagle3-vocab-map": dict(draft_vocab_size=100),
    "eagle3.1-two-layers": dict(
        draft_vocab_size=100, fc_norm=True, norm_output=True, num_hidden_layers=2, norm_before_residual=True
    ),
    "eagle3-norm-before-fc": dict(norm_before_fc=True, draft_vocab_size=200),
    "eagle3-two-aux": dict(aux_layer_ids=[2, 5]),
    "eagle3-narrow": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64),
    "peagle": dict(algorithm="peagle", draft_vocab_size=100, mask_token_id=3, num_hidden_layers=2),
    "peagle-full-vocab": dict(
        algorithm="peagle", mask_token_id=319, num_hidden_layers=3, speculative_tokens=7
    ),
}


def _embed(head):
    return head.embed_tokens.weight.detach().clone()


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_same_logits(tmp_path, variant, fmt):
    head = random_head(**VARIANTS[variant])
    out = export_head(head, tmp_path / "x", fmt=fmt, dtype=torch.float32)
    assert validate_export(out) == []
    back = load_any_head(out, target_embed=_embed(head))
    assert type(back) is type(head)
    assert back.config == head.config
    assert torch.equal(step_logits(back), step_logits(head))
    if head.config.uses_vocab_map:
        assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    if isinstance(head, PEagleHead):
        assert torch.equal(back.mask_hidden, head.mask_hidden)
        ids = torch.tensor([[5, 9]])
        aux = torch.randn(1, 2, head.config.fc_in_features, generator=torch.Generator().manual_seed(0))
        pos = torch.arange(2)[None]
        a = head.draft(head.new_cache(), ids, aux, pos, k=4)
        b = back.draft(back.new_cache(), ids, aux, pos, k=4)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bf16_export_equals_the_head_rounded_to_bf16(tmp_path):
    head = random_head(draft_vocab_size=100, fc_norm=True)
    out = export_head(head, tmp_path / "x")  # default dtype: bfloat16
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    back = load_any_head(out, target_embed=_embed(head), dtype=torch.float32)
    rounded = random_head(draft_vocab_size=100, fc_norm=True)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rounded.embed_tokens.weight.data.copy_(
        head.embed_tokens.weight
    )  # the embedding is the target's, not exported
    assert torch.equal(step_logits(back), step_logits(rounded))


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
@pytest.mark.parametrize("variant", ["eagle3-vocab-map", "peagle", "eagle3-narrow"])
def test_import_then_export_is_bit_for_bit(tmp_path, variant, fmt):
    head = random_head(**VARIANTS[variant])
    first = export_head(head, tmp_path / "a", fmt=fmt)
    back = load_any_head(first, target_embed=_embed(head))
    second = export_head(back, tmp_path / "b", fmt=fmt)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())


def test_published_head_with_embedding_keeps_it_on_reexport(tmp_path):
    head = random_head()
    first = export_head(head, tmp_path / "a")
    tensors = load_file(str(first / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors  # frozen target embedding: not shipped
    tensors["embed_tokens.weight"] = head.embed_tokens.weight.detach().to(torch.bfloat16)
    from safetensors.torch import save_file

    save_file(tensors, str(first / "model.safetensors"))
    back = load_any_head(first)  # no target_embed needed now
    second = export_head(back, tmp_path / "b")
    assert "embed_tokens.weight" in load_file(str(second / "model.safetensors"))


def test_speculators_config_matches_the_contract(tmp_path):
    head = random_head(
        algorithm="peagle", draft_vocab_size=100, mask_token_id=3, num_hidden_layers=2, fc_norm=True
    )
    cfg = json.loads((export_head(head, tmp_path / "x") / "config.json").read_text())
    assert "model_type" not in cfg
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] and cfg["speculators_version"]
    layer = cfg["transformer_layer_config"]
    assert layer["vocab_size"] == 320 and layer["num_hidden_layers"] == 2 and layer["model_type"] == "llama"
    assert layer["num_aux_hidden_states"] == 3
    assert cfg["draft_vocab_size"] == 100 and cfg["target_hidden_size"] == 64
    assert cfg["norm_before_residual"] is False and cfg["fc_norm"] is True and "norm_output" not in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    assert cfg["mask_token_id"] == 3 and cfg["ptd_token_id"] == 3
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "peagle" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
    tensors = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert not any(k.startswith("model.") for k in tensors)
    assert tensors["mask_hidden"].shape == (1, 192) and tensors["embed_tokens.weight"].shape == (320, 64)


def test_eagle_layout_names_a_single_layer_midlayer(tmp_path):
    head = random_head(draft_vocab_size=100)
    out = export_head(head, tmp_path / "x", fmt="eagle")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    names = load_file(str(out / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in names and not any(k.startswith("layers.") for k in names)
    assert detect_format(out) == "eagle"


@pytest.mark.parametrize("variant", ["eagle3", "peagle"])
def test_export_checkpoint_and_load_any_head(tmp_path, variant):
    head = random_head(**({"draft_vocab_size": 100} if variant == "eagle3" else VARIANTS["peagle"]))
    if variant == "peagle":
        with torch.no_grad():
            head.mask_embedding.add_(1.0)  # learned away from the table's row, as training does
    ckpt = save_head(head, tmp_path / "ckpt")
    out = export_checkpoint(ckpt, tmp_path / "export", dtype=torch.float32)
    assert validate_export(out) == []
    assert detect_format(ckpt) == "eyas" and detect_format(out) == "speculators"
    for d in (ckpt, out):
        loaded = load_any_head(d, target_embed=_embed(head))
        assert type(loaded) is type(head)
        assert torch.equal(step_logits(loaded), step_logits(head))
    if variant == "peagle":
        # the learned mask row ships inside the table, the one tensor vLLM reads for it
        served = load_file(str(out / "model.safetensors"))
        assert "mask_embedding" not in served
        mask = head.config.mask_token_id
        assert torch.equal(served["embed_tokens.weight"][mask], head.mask_embedding.detach())
        assert not torch.equal(head.embed_tokens.weight[mask], head.mask_embedding)  # not the stale row
        ids = torch.tensor([[5, mask]])
        torch.testing.assert_close(loaded.embed(ids), head.embed(ids), rtol=0, atol=0)


def test_frozen_embedding_head_needs_target_embed(tmp_path):
    out = export_head(random_head(), tmp_path / "x")
    with pytest.raises(ValueError, match="target_embed"):
        load_any_head(out)


def test_serve_command():
    cmd = serve_command("/heads/x", random_head(algorithm="peagle", mask_token_id=3).config)
    assert cmd.startswith("vllm serve org/tiny-target --speculative-config ")
    spec = json.loads(cmd.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {
        "method": "eagle3",
        "model": "/heads/x",
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }
