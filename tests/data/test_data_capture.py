"""Features, capture, cache: equality with HF hidden states, resume, verify, fp8, disk."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from eyas.data.cache import DamagedShardError, FeatureCache, bytes_per_token, verify_cache
from eyas.data.capture import CaptureError, InjectedFailure, capture_split
from eyas.data.capture_plan import plan_capture
from eyas.data.capture_settings import CaptureSettings
from eyas.target.features import compute_features, default_aux_layer_ids, target_norm_and_lm_head
from eyas.target.load import load_target


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(48) == (2, 24, 45)
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    for L in range(4, 9):
        ids = default_aux_layer_ids(L)
        assert len(set(ids)) == 3 and list(ids) == sorted(ids) and 1 <= ids[0] and ids[-1] <= L - 1


def test_features_equal_hidden_states_and_prenorm(tiny_target_dir):
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    torch.manual_seed(0)
    ids = torch.randint(4, 300, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    aux_ids = (1, 3, 6)
    aux, last = compute_features(target.model, ids, mask, aux_ids)
    out = target.model(ids, attention_mask=mask, output_hidden_states=True)
    H = target.hidden_size
    assert aux.shape == (2, 10, 3 * H) and last.shape == (2, 10, H)
    for k, i in enumerate(aux_ids):
        torch.testing.assert_close(aux[..., k * H : (k + 1) * H], out.hidden_states[i], rtol=0, atol=0)
    norm, lm_head = target_norm_and_lm_head(target.model)
    torch.testing.assert_close(norm(last), out.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(lm_head(norm(last)), out.logits, rtol=1e-6, atol=1e-6)


def _toy_split(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        T = int(torch.randint(5, 40, (1,), generator=g))
        rows.append(torch.randint(4, 300, (T,), generator=g).tolist())
    return {"input_ids": rows, "loss_mask": [[0] * 3 + [1] * (len(r) - 3) for r in rows]}


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(str(tiny_llama_dir), dtype="float32", device="cpu")


def test_plan_is_length_bucketed():
    plan = plan_capture([5, 30, 7, 6, 31], batch_tokens=20, shard_tokens=25)
    batches = [b for s in plan.shards for b in s]
    assert batches == [[0, 3], [2], [1], [4]]
    assert sorted(i for b in batches for i in b) == list(range(5))


def test_capture_roundtrip_and_cache_reader(llama, tmp_path):
    split = _toy_split()
    aux_ids = [2, 4, 5]
    settings = CaptureSettings(aux_ids, batch_tokens=64, shard_tokens=50, progress=False)
    m = capture_split(llama.model, split, tmp_path / "train", settings)
    assert m["complete"] and len(m["shards"]) >= 3 and m["num_samples"] == 12
    cache = FeatureCache(tmp_path)  # the cache root works: split "train" by default
    assert len(cache) == 12 and sorted(cache.lengths) == sorted(len(r) for r in split["input_ids"])
    assert cache.aux_layer_ids == aux_ids and cache.verify() == []
    seen = set()
    for i in range(len(cache)):
        s = cache[i]
        j = s["sample_index"]
        seen.add(j)
        ids = torch.tensor(split["input_ids"][j])
        assert torch.equal(s["input_ids"], ids) and s["loss_mask"].tolist() == split["loss_mask"][j]
        aux, last = compute_features(llama.model, ids[None], None, aux_ids)
        # the capture ran padded batches, this one sample alone: float32 sums of another
        # blocking may round to the neighbouring bf16 value (seen on AMD EPYC), never further
        torch.testing.assert_close(s["aux"].float(), aux[0].bfloat16().float(), rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(s["last"].float(), last[0].bfloat16().float(), rtol=2**-7, atol=1e-6)
    assert seen == set(range(12))


def test_killed_capture_resumes_to_the_same_manifest(llama, tmp_path):
    split = _toy_split(seed=1)
    settings = CaptureSettings([2, 4, 5], batch_tokens=64, shard_tokens=40, progress=False)
    ref = capture_split(llama.model, split, tmp_path / "ref", settings)
    with pytest.raises(InjectedFailure):
        capture_split(llama.model, split, tmp_path / "run", settings, fail_after_shards=2)
    partial = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not partial["complete"] and len(partial["shards"]) == 2 < len(ref["shards"])
    with pytest.raises(RuntimeError, match="incomplete"):
        FeatureCache(tmp_path / "run")
    resumed = capture_split(llama.model, split, tmp_path / "run", settings)
    assert resumed == ref
    # Other settings over an old cache are refused, not mixed in.
    with pytest.raises(CaptureError, match="other data or settings"):
        capture_split(llama.model, split, tmp_path / "run", replace(settings, aux_layer_ids=[1, 2, 3]))


def test_flipped_byte_is_named_by_verify_and_refused(llama, tmp_path):
    split = _toy_split(seed=2)
    settings = CaptureSettings([2, 4, 5], batch_tokens=64, shard_tokens=40, progress=False)
    m = capture_split(llama.model, split, tmp_path / "cache" / "train", settings)
    victim = tmp_path / "cache" / "train" / m["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    problems = verify_cache(tmp_path / "cache", "train")
    assert len(problems) == 1 and victim.name in problems[0] and "checksum" in problems[0]
    cache = FeatureCache(tmp_path / "cache")
    first_bad = cache._shard_start[1]
    cache[0]  # an intact shard still reads
    with pytest.raises(DamagedShardError, match=victim.name):
        cache[first_bad]
    # The CLI names it too.
    out = subprocess.run(
        [sys.executable, "-m", "eyas", "capture", f"run_dir={tmp_path}", "--verify", "--splits", "train"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and victim.name in out.stdout
    # Deleting the damaged shard and rerunning recomputes exactly it.
    victim.unlink()
    again = capture_split(llama.model, split, tmp_path / "cache" / "train", settings)
    assert again == m and verify_cache(tmp_path / "cache", "train") == []


def test_fp8_cache_halves_aux_and_stays_close(llama, tmp_path):
    split = _toy_split(seed=3)
    settings = CaptureSettings([2, 4, 5], batch_tokens=64, shard_tokens=10_000, progress=False)
    capture_split(llama.model, split, tmp_path / "bf16", settings)
    capture_split(llama.model, split, tmp_path / "fp8", replace(settings, aux_dtype="fp8"))
    a, b = FeatureCache(tmp_path / "bf16"), FeatureCache(tmp_path / "fp8")
    for i in range(len(a)):
        x, y = a[i]["aux"].float(), b[i]["aux"].float()
        assert b[i]["aux"].dtype == torch.bfloat16
        assert (x - y).norm() / x.norm() < 0.05
        assert torch.equal(a[i]["last"], b[i]["last"])
    H = llama.hidden_size
    assert bytes_per_token(3, H, "fp8") < 0.75 * bytes_per_token(3, H, "bf16")


def test_capture_refuses_when_the_disk_is_too_small(llama, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    with pytest.raises(CaptureError, match="GB free"):
        capture_split(llama.model, _toy_split(), tmp_path / "c", CaptureSettings([2, 4, 5], progress=False))
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_capture_entry_point_writes_every_split_and_refuses_without_prepared_data(tmp_path, tiny_llama_dir):
    from support.train_run_fixtures import tiny_recipe, write_conversations

    from eyas.data.cache import read_manifest
    from eyas.data.capture import capture
    from eyas.data.prepare import prepare

    write_conversations(tmp_path / "conversations.jsonl", 12)
    recipe = tiny_recipe(tmp_path / "run", tiny_llama_dir)
    with pytest.raises(CaptureError, match=str(recipe.paths.prepared)):
        capture(recipe, progress=False)
    prepare(recipe, progress=False)
    said = []
    manifests = capture(recipe, progress=False, say=said.append)
    assert set(manifests) == {"train", "eval"}
    for split, m in manifests.items():
        assert m == read_manifest(recipe.paths.cache / split) and m["complete"]
        assert len(FeatureCache(recipe.paths.cache, split)) == m["num_samples"] > 0
    assert any("aux layers" in line for line in said)


def test_rerunning_capture_over_a_damaged_shard_recomputes_it(tmp_path, tiny_llama_dir, caplog):
    """`eyas capture` again after a shard was damaged: the damaged shard is named and
    recomputed (the intact ones are kept), so --verify passes afterwards; before, the rerun
    called the capture complete and --verify still named the shard."""
    from support.train_run_fixtures import captured_in_shards

    from eyas.cli import main

    recipe, path = captured_in_shards(tmp_path, tiny_llama_dir)
    split_dir = recipe.paths.cache / "train"
    intact = json.loads((split_dir / "manifest.json").read_text())
    assert len(intact["shards"]) >= 2
    victim = split_dir / intact["shards"][-1]["file"]
    kept = split_dir / intact["shards"][0]["file"]
    kept_mtime = kept.stat().st_mtime_ns
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert main(["capture", "--verify", "-r", str(path)]) == 1

    caplog.clear()
    assert main(["capture", "--no-progress", "-r", str(path)]) == 0
    named = [r.getMessage() for r in caplog.records if victim.name in r.getMessage()]
    assert any("checksum mismatch" in m and "recomputing" in m for m in named), caplog.text
    assert json.loads((split_dir / "manifest.json").read_text()) == intact
    assert kept.stat().st_mtime_ns == kept_mtime  # the intact shard was not rewritten
    assert main(["capture", "--verify", "-r", str(path)]) == 0


def test_a_full_disk_under_a_cache_write_names_the_file_and_leaves_no_half_file(tmp_path, monkeypatch):
    import errno
    import os

    from eyas.cli import known_failure
    from eyas.data.cache import atomic_write

    target = tmp_path / "shard-00003.safetensors"
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        atomic_write(target, b"new bytes")
    assert err.value.filename == str(target) and err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name] and target.read_bytes() == b"old"
    assert known_failure(err.value).startswith(f"no space left on the device writing {target}")
