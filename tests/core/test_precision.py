"""`dtype: auto` / `mixed_precision: auto`: bf16 where it measured faster, on this machine,
for the model's own shapes; the verdict is cached and logged."""

import json
import logging

import pytest
import torch

from eyas.core import precision
from eyas.core.cache_dir import eyas_cache_dir
from eyas.recipe import recipe_from_dict
from eyas.target.load import load_target


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """A fake timer: call with the seconds bf16 and float32 take; returns the list of
    dtypes actually timed (a cached verdict times nothing)."""
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def set_times(bf16: float, fp32: float):
        def fake(dtype, shapes, seconds=0.15, give_up_above=None):
            calls.append(dtype)
            return bf16 if dtype == torch.bfloat16 else fp32

        monkeypatch.setattr(precision, "time_matmuls", fake)
        return calls

    return set_times


@pytest.mark.parametrize(
    "bf16, fp32, dtype, mixed", [(0.004, 0.008, "bfloat16", "bf16"), (0.010, 0.005, "float32", "no")]
)
def test_auto_takes_the_faster_dtype_and_caches_the_verdict(timed, caplog, bf16, fp32, dtype, mixed):
    calls = timed(bf16, fp32)
    with caplog.at_level(logging.INFO, logger="eyas.core.precision"):
        assert precision.resolve_dtype("auto", "cpu") == dtype
    assert set(calls) == {torch.bfloat16, torch.float32}
    timings = len(calls)
    said = caplog.text
    assert f"dtype auto: {dtype}" in said
    assert f"bf16 {bf16 * 1e3:.2f} ms" in said and f"float32 {fp32 * 1e3:.2f} ms" in said
    cached = json.loads((eyas_cache_dir() / precision.CACHE_NAME).read_text())
    (verdict,) = cached.values()
    assert verdict["faster"] == dtype and verdict["bfloat16_ms"] == bf16 * 1e3
    # the next stage (and the next run) reads the verdict instead of timing again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eyas.core.precision"):
        assert precision.resolve_mixed_precision("auto", torch.device("cpu")) == mixed
    assert len(calls) == timings and "cached" in caplog.text


def test_the_verdict_is_per_shape(timed):
    calls = timed(0.004, 0.008)
    precision.resolve_dtype("auto", "cpu", precision.MatmulShapes(rows=256))
    precision.resolve_dtype("auto", "cpu", precision.MatmulShapes(rows=1))
    per_verdict = len(calls) // 2
    precision.resolve_dtype("auto", "cpu", precision.MatmulShapes(rows=256))
    assert len(calls) == 2 * per_verdict
    assert len(json.loads((eyas_cache_dir() / precision.CACHE_NAME).read_text())) == 2


def test_a_damaged_cache_is_measured_again(timed):
    calls = timed(0.010, 0.005)
    path = eyas_cache_dir() / precision.CACHE_NAME
    path.parent.mkdir(parents=True)
    path.write_text('{"cut off')
    assert precision.resolve_dtype("auto", "cpu") == "float32" and set(calls) == {
        torch.bfloat16,
        torch.float32,
    }
    assert json.loads(path.read_text())


def test_a_far_slower_bf16_is_timed_once(timed):
    """On a CPU that emulates bf16 a run takes seconds: one round settles the verdict."""
    calls = timed(2.0, 0.01)
    assert precision.resolve_dtype("auto", "cpu") == "float32"
    assert calls == [torch.float32, torch.bfloat16]


def test_an_emulated_bf16_is_settled_on_a_sixteenth_of_the_rows(monkeypatch, tmp_path):
    # one full-size bf16 multiply took a minute on an AVX2-only EPYC: the screen decides first
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path))
    rows = []

    def fake(dtype, shapes, seconds=0.15, give_up_above=None):
        rows.append(shapes.rows)
        return (2.0 if dtype == torch.bfloat16 else 0.01) * shapes.rows / 256

    monkeypatch.setattr(precision, "time_matmuls", fake)
    spent = precision.measuring_seconds()
    assert precision.resolve_dtype("auto", "cpu", precision.MatmulShapes(rows=256)) == "float32"
    assert rows == [16, 16]
    # measuring is counted (the budget's probe leaves it out of a stage's start-up)...
    assert precision.measuring_seconds() > spent
    spent = precision.measuring_seconds()
    precision.resolve_dtype("auto", "cpu", precision.MatmulShapes(rows=256))
    assert precision.measuring_seconds() == spent  # ...reading the cached verdict is not
    (verdict,) = json.loads((eyas_cache_dir() / precision.CACHE_NAME).read_text()).values()
    assert verdict["shapes"]["rows"] == 16
    # where bf16 is not far slower, the verdict is taken at the full rows
    rows.clear()
    monkeypatch.setattr(
        precision, "time_matmuls", lambda dtype, shapes, *a, **k: rows.append(shapes.rows) or 0.01
    )
    precision.resolve_dtype("auto", "cpu", precision.MatmulShapes(rows=128))
    assert rows[:2] == [8, 8] and set(rows[2:]) == {128}


def test_the_timer_stops_after_a_run_slower_than_the_bound(monkeypatch):
    shapes = precision.MatmulShapes(hidden=64, intermediate=128, vocab=1000, rows=8)
    mm = torch.mm
    runs = []

    def counted(a, b):
        runs.append(1)
        return mm(a, b)

    monkeypatch.setattr(precision.torch, "mm", counted)
    precision.time_matmuls(torch.float32, shapes, seconds=0.01, give_up_above=0.0)
    assert len(runs) == 2  # the warm-up's two multiplies, nothing more
    runs.clear()
    precision.time_matmuls(torch.float32, shapes, seconds=0.01)
    assert len(runs) >= 4


def test_the_real_timer_times_both_dtypes_quickly():
    shapes = precision.MatmulShapes(hidden=64, intermediate=128, vocab=1000, rows=8)
    for dtype in (torch.bfloat16, torch.float32):
        t = precision.time_matmuls(dtype, shapes, seconds=0.01)
        assert 0 < t < 1


def test_shapes_come_from_the_model_config(tiny_llama_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    s = precision.shapes_of_config(config, rows=32, vocab=100)
    assert (s.hidden, s.intermediate, s.vocab, s.rows) == (
        config.hidden_size,
        config.intermediate_size,
        100,
        32,
    )
    big = precision.MatmulShapes(hidden=2880, intermediate=2880, vocab=201088, rows=4096).timed()
    assert big.vocab == precision.MAX_TIMED_VOCAB and big.rows == precision.MAX_TIMED_ROWS


def test_explicit_settings_are_kept(timed):
    calls = timed(0.004, 0.008)
    for name in ("bfloat16", "float16", "float32"):
        assert precision.resolve_dtype(name, "cpu") == name
    for name in ("bf16", "fp16", "no"):
        assert precision.resolve_mixed_precision(name, "cpu") == name
    assert calls == []


def test_recipes_default_to_auto_and_reject_unknown_dtypes():
    recipe = recipe_from_dict({"name": "x"})
    assert recipe.target.dtype == "auto" and recipe.train.mixed_precision == "auto"
    with pytest.raises(ValueError, match="dtype"):
        recipe_from_dict({"name": "x", "target": {"dtype": "bf32"}})


@pytest.mark.parametrize("bf16, expected", [(0.010, torch.float32), (0.001, torch.bfloat16)])
def test_load_target_auto_loads_the_faster_dtype(tiny_llama_dir, timed, bf16, expected):
    timed(bf16, 0.005)
    model = load_target(str(tiny_llama_dir), dtype="auto", device="cpu").model
    assert {p.dtype for p in model.parameters()} == {expected}
