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


def test_a_trainer_reading_no_layer_loads_a_quantized_target_without_its_kernels(
    mxfp4_gpt_oss_dir, monkeypatch
):
    """The trainer fed states by a cache builds no decoder layer: it reads no MXFP4 weight,
    so a node without triton / kernels loads the embeddings, norm and LM head it needs."""
    from safetensors.torch import load_file

    import eyas.target.quantized as quantized

    monkeypatch.setattr(quantized, "_triton_at_least", lambda version: False)
    monkeypatch.setattr(quantized, "_installed", lambda module: False)
    with pytest.raises(QuantizationError, match="lacks"):  # a load that reads the experts
        load_target(str(mxfp4_gpt_oss_dir), dtype="float32", device="cpu")
    target = load_target(str(mxfp4_gpt_oss_dir), dtype="float32", device="cpu", decoder_layers=False)
    saved = load_file(str(mxfp4_gpt_oss_dir / "model.safetensors"))
    assert len(target.model.model.layers) == 0
    assert target.model.config.num_hidden_layers == len({k.split(".")[2] for k in saved if ".layers." in k})
    torch.testing.assert_close(
        target.model.get_input_embeddings().weight, saved["model.embed_tokens.weight"].float()
    )
    torch.testing.assert_close(target.model.model.norm.weight, saved["model.norm.weight"].float())


def test_a_failed_kernel_fetch_is_reported_with_its_remedies(mxfp4_gpt_oss_dir, monkeypatch):
    """transformers fetches the MXFP4 kernel from the Hub while loading; on an offline node
    the kernels package's own error is raised (here for real: the tests run offline)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.hub_kernels import get_kernel

    import eyas.target.quantized as quantized

    def load_fetching_the_kernel(*args, **kwargs):
        get_kernel("kernels-community/gpt-oss-triton-kernels", version=1)  # as transformers' mxfp4 loader
        raise AssertionError("the kernel is not in this machine's cache: the fetch should have failed")

    monkeypatch.setattr(quantized, "missing_kernels", lambda method, device_type: [])
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load_fetching_the_kernel)
    with pytest.raises(QuantizationError) as caught:
        load_target(str(mxfp4_gpt_oss_dir), dtype="bfloat16", device="cpu")
    message = str(caught.value)
    assert "kernels-community/gpt-oss-triton-kernels" in message
    assert "HF_HUB_OFFLINE=1" in message and "target.dequantize: true" in message
    assert isinstance(caught.value.__cause__, ValueError)  # the kernels package's error, kept as the cause

    def load_failing_otherwise(*args, **kwargs):
        raise ValueError("some other load failure")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load_failing_otherwise)
    with pytest.raises(ValueError, match="some other load failure"):  # not dressed up as a kernel fetch
        load_target(str(mxfp4_gpt_oss_dir), dtype="bfloat16", device="cpu")


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
