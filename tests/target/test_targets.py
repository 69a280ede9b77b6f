"""Loading frozen targets: tiny random families, and the real SmolLM2 (slow)."""

import pytest

from eyas.target.load import TargetLoadError, attention_implementation, load_target


def test_tiny_target_loads_frozen_and_exposes_hidden_states(tiny_target_dir):
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    out = target.model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == target.num_layers + 1
    assert out.hidden_states[0].shape == (1, ids.shape[1], target.hidden_size)
    assert out.logits.shape[-1] == target.vocab_size


def test_target_runs_its_own_modules_not_hub_kernels(tiny_llama_dir):
    """transformers kernelizes a loaded model with kernels fetched from the Hub by default
    (on a GPU: code nobody asked for, and offline a failed load, as seen on an H200); the
    target eyas loads keeps its own modules."""
    assert load_target(str(tiny_llama_dir), dtype="float32", device="cpu").model.use_kernels is False


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_attention_is_one_the_architecture_accepts(family):
    """GPT-OSS's class refuses SDPA on every device (a GPU included): eager on a CPU, flex
    attention on a GPU, SDPA for the others; the model builds with the choice, and an
    explicit request wins."""
    from support.tiny_targets import tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    chosen = attention_implementation(cfg)
    assert chosen == ("eager" if family == "gpt_oss" else "sdpa")
    # on a GPU, GPT-OSS's sinks run fused (flex attention renormalises by them), never eager
    assert attention_implementation(cfg, None, "cuda") == (
        "flex_attention" if family == "gpt_oss" else "sdpa"
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=chosen)
    assert model.config._attn_implementation == chosen
    assert attention_implementation(cfg, "flex_attention") == "flex_attention"


def test_a_cached_decode_step_continues_the_context(tiny_llama_dir):
    """`cache=` (the keyword regeneration and eval decode through) reaches the model: a
    step's logits equal a full forward's. transformers releases before the rename take
    `past_key_values`, swallow `cache` and decode without the context (pyproject's floor)."""
    import torch
    from transformers import DynamicCache

    model = load_target(str(tiny_llama_dir), dtype="float32", device="cpu").model
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :8], cache=cache, use_cache=True)
    step = model(input_ids=ids[:, 8:], cache=cache, use_cache=True).logits[0, -1]
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(step, model(input_ids=ids).logits[0, -1], rtol=1e-4, atol=1e-4)


def test_cpu_targets_decode_with_the_grouped_or_folded_attention_that_timed_faster(
    tiny_llama_dir, monkeypatch
):
    """On CPU the decode attention of a grouped-query target is timed both ways once per
    machine and shape: where the grouped kernel (`enable_gqa`) is faster a padded batch
    reaches torch with the KV heads grouped, else transformers folds or copies them; both
    give the same logits, the verdict is cached, and a value the user exported is kept."""
    import os

    import torch
    import torch.nn.functional as F

    from eyas.core import decode_attention
    from eyas.core.decode_attention import GQA_SDPA_ENV

    monkeypatch.setenv("EYAS_CACHE_DIR", str(tiny_llama_dir.parent / "timing-cache"))
    monkeypatch.delenv(GQA_SDPA_ENV, raising=False)
    timed = []
    faster = {"grouped": True}

    def fake_time(shapes, grouped, seconds=0.1):
        timed.append(grouped)
        return 1.0 if grouped == faster["grouped"] else 2.0

    monkeypatch.setattr(decode_attention, "time_decode_attention", fake_time)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids = torch.randint(3, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :1] = 0  # left padding
    real = mask.bool()

    model = load_target(str(tiny_llama_dir), dtype="float32", device="cpu", work_rows=3).model
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert os.environ[GQA_SDPA_ENV] == "1" and timed
    grouped = model(input_ids=ids, attention_mask=mask).logits
    assert seen and all(heads == model.config.num_key_value_heads and gqa for heads, gqa in seen)

    faster["grouped"] = False  # another machine: a shape not timed yet
    seen.clear()
    model = load_target(str(tiny_llama_dir), dtype="float32", device="cpu", work_rows=5).model
    assert os.environ[GQA_SDPA_ENV] == "0"
    folded = model(input_ids=ids, attention_mask=mask).logits
    assert seen and not any(gqa for _, gqa in seen)
    torch.testing.assert_close(grouped[real], folded[real], rtol=1e-5, atol=1e-5)

    timed.clear()  # the first shape again: read from the cache, not timed
    load_target(str(tiny_llama_dir), dtype="float32", device="cpu", work_rows=3)
    assert os.environ[GQA_SDPA_ENV] == "1" and not timed

    monkeypatch.setenv(GQA_SDPA_ENV, "0")  # the user's own choice stays
    load_target(str(tiny_llama_dir), dtype="float32", device="cpu", work_rows=3)
    assert os.environ[GQA_SDPA_ENV] == "0" and not timed


def test_decode_attention_timing_runs_both_sdpa_calls():
    """The timing itself runs the two calls transformers would make, at the given shape."""
    from eyas.core.decode_attention import DecodeShapes, time_decode_attention

    shapes = DecodeShapes(rows=4, heads=6, kv_heads=2, head_dim=16, dtype="float32", keys=32)
    assert time_decode_attention(shapes, True, seconds=0.001) > 0
    assert time_decode_attention(shapes, False, seconds=0.001) > 0


def test_missing_local_target_is_a_clear_error(tmp_path):
    for name in (str(tmp_path / "nope"), "nope", "./models/nope"):
        with pytest.raises(TargetLoadError, match=f"target {name!r}: no such directory"):
            load_target(name, device="cpu")


@pytest.mark.slow
def test_smollm2_alias_answers_paris():
    target = load_target("smollm2-135m", device="cpu")
    tok = target.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    out = target.model.generate(ids, max_new_tokens=24, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_a_target_without_decoder_layers_keeps_its_embeddings_head_and_config(tiny_llama_dir, caplog):
    """What a trainer fed states by a cache or an engine loads: no decoder layer, the same
    embeddings, final norm and LM head as the whole target, a config naming every layer,
    and no load report listing the layers it skipped."""
    import torch

    from eyas.target.features import target_norm_and_lm_head

    whole = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    caplog.clear()
    bare = load_target(str(tiny_llama_dir), dtype="float32", device="cpu", decoder_layers=False)
    assert len(bare.model.model.layers) == 0 and bare.num_layers == whole.num_layers > 0
    assert "UNEXPECTED" not in caplog.text
    assert torch.equal(bare.model.get_input_embeddings().weight, whole.model.get_input_embeddings().weight)
    for a, b in zip(target_norm_and_lm_head(bare.model), target_norm_and_lm_head(whole.model)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert sum(p.numel() for p in bare.model.parameters()) < sum(p.numel() for p in whole.model.parameters())
