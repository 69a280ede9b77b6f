"""Loading a target as at scale, on tiny targets: each rank straight onto its own device,
a quantized checkpoint never silently dequantized."""

import json

import pytest
import torch

from eyas.target.load import load_target, resolve_device
from eyas.target.quantized import QuantizationError, check_still_quantized


@pytest.fixture
def mxfp4_gpt_oss_dir(tmp_path):
    """A tiny GPT-OSS whose config says its checkpoint is MXFP4, as the published one."""
    from support.tiny_targets import save_tiny_target

    out = save_tiny_target("gpt_oss", tmp_path / "gpt-oss")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_quantized_target_whose_kernels_are_missing_is_refused(mxfp4_gpt_oss_dir, monkeypatch):
    import eyas.target.quantized as quantized

    monkeypatch.setattr(quantized, "_triton_at_least", lambda version: False)
    monkeypatch.setattr(quantized, "_installed", lambda module: False)
    with pytest.raises(
        QuantizationError, match=r"lacks triton>=3.4 and kernels: pip install .*target.dequantize"
    ):
        load_target(str(mxfp4_gpt_oss_dir), dtype="bfloat16", device="cuda:0")


def test_a_target_that_loaded_dequantized_is_refused_unless_accepted(mxfp4_gpt_oss_dir):
    from support.tiny_targets import build_tiny_model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(mxfp4_gpt_oss_dir)
    bf16 = build_tiny_model("gpt_oss").to(torch.bfloat16)  # what transformers' fallback leaves
    with pytest.raises(QuantizationError, match="loaded dequantized"):
        check_still_quantized(bf16, config, dequantize=False, name="t")
    check_still_quantized(bf16, config, dequantize=True, name="t")  # the user said bf16
    kept = bf16.model.layers[0].mlp.experts
    kept.register_buffer("gate_up_proj_blocks", torch.zeros(2, 2, dtype=torch.uint8))
    check_still_quantized(bf16, config, dequantize=False, name="t")


def test_each_rank_loads_onto_its_own_device(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)
    from transformers import AutoModelForCausalLM

    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        calls.append(kwargs)
        return real(path, **{k: v for k, v in kwargs.items() if k != "device_map"})  # CPU stands in

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: pytest.fail("a whole-model .to() copy"))
    target = load_target(str(tiny_llama_dir), dtype="bfloat16", device="auto")
    assert calls[0]["device_map"] == {"": torch.device("cuda", 3)}
    assert not target.model.training


def test_cpu_targets_load_on_the_host_without_a_device_map(tiny_llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda p, **kw: calls.append(kw) or real(p, **kw)
    )
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert "device_map" not in calls[0] and next(target.model.parameters()).device.type == "cpu"
