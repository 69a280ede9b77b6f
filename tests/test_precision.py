"""`dtype: auto` / `mixed_precision: auto`: bf16 only where the device runs it natively."""

import pytest
import torch

from eyas import precision
from eyas.data.targets import load_target
from eyas.recipe import recipe_from_dict


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set what the CPU probes report: call with True (AVX512-BF16) or False (neither)."""

    def set_native(native: bool):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        precision._cpu_has_native_bf16.cache_clear()

    yield set_native
    precision._cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize("native, dtype, mixed", [(True, "bfloat16", "bf16"), (False, "float32", "no")])
def test_auto_follows_the_cpu(cpu_bf16, native, dtype, mixed):
    cpu_bf16(native)
    assert precision.resolve_dtype("auto", "cpu") == dtype
    assert precision.resolve_mixed_precision("auto", torch.device("cpu")) == mixed


def test_amx_alone_counts_as_native(monkeypatch, cpu_bf16):
    cpu_bf16(False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    precision._cpu_has_native_bf16.cache_clear()
    assert precision.resolve_dtype("auto", "cpu") == "bfloat16"


def test_explicit_settings_are_kept(cpu_bf16):
    cpu_bf16(False)
    for name in ("bfloat16", "float16", "float32"):
        assert precision.resolve_dtype(name, "cpu") == name
    for name in ("bf16", "fp16", "no"):
        assert precision.resolve_mixed_precision(name, "cpu") == name


def test_recipes_default_to_auto_and_reject_unknown_dtypes():
    recipe = recipe_from_dict({"name": "x"})
    assert recipe.target.dtype == "auto" and recipe.train.mixed_precision == "auto"
    with pytest.raises(ValueError, match="dtype"):
        recipe_from_dict({"name": "x", "target": {"dtype": "bf32"}})


@pytest.mark.parametrize("native, expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_load_target_auto_loads_the_native_dtype(tiny_llama_dir, cpu_bf16, native, expected):
    cpu_bf16(native)
    model = load_target(str(tiny_llama_dir), dtype="auto", device="cpu").model
    assert {p.dtype for p in model.parameters()} == {expected}
