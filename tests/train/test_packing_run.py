"""`train.packing` in a training run: batches carry `segments` only when packing, and a
packed run killed mid-epoch resumes at the same row with bit-identical losses."""

import json
import shutil

import torch
from safetensors.torch import load_file
from support.train_run_fixtures import prepare_run

from eyas.data.cache import FeatureCache
from eyas.train.batching import BatchStream, DataPosition, Packing, collate, plan_epoch
from eyas.train.feed import batch_stream


def _losses(recipe):
    lines = [json.loads(x) for x in (recipe.paths.root / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["train/loss"] for x in lines if "train/loss" in x}


def test_packed_run_resumes_mid_epoch_with_identical_losses(tmp_path, tiny_llama_dir):
    from eyas.train.loop import train

    recipe = prepare_run(
        tmp_path,
        tiny_llama_dir,
        "offline",
        n=24,
        packing=True,
        batch_tokens=256,
        max_steps=6,
        save_every=3,
        keep_checkpoints=0,
        eval_every=0,
    )
    stream = batch_stream(recipe, FeatureCache(recipe.paths.cache, "train"), 0, 1)
    per_epoch = stream.batches_per_epoch()
    first = next(stream)
    assert first["input_ids"].shape[0] == 1 and first["segments"].max() >= 1  # rows hold several samples
    assert 3 % per_epoch != 0  # the checkpoint at step 3 falls inside an epoch

    train(recipe, progress=False)
    straight = _losses(recipe)
    head = load_file(str(recipe.paths.checkpoints / "final" / "head.safetensors"))
    state = json.loads((recipe.paths.checkpoints / "step-00000003" / "state.json").read_text())
    assert state["batches"] == 3 % per_epoch
    # as if killed after the checkpoint at step 3
    for name in ("step-00000006", "final"):
        shutil.rmtree(recipe.paths.checkpoints / name)
    summary = train(recipe, progress=False)
    assert summary["step"] == 6
    resumed = _losses(recipe)
    assert sorted(resumed) == sorted(straight) == list(range(1, 7))
    assert resumed == straight  # bit-identical floats, steps 4-6 trained again
    again = load_file(str(recipe.paths.checkpoints / "final" / "head.safetensors"))
    assert all(torch.equal(head[k], again[k]) for k in head)


def test_unpacked_batches_are_the_bucketed_ones():
    """Without train.packing (the default) the stream yields what it did before the key:
    the bucketed plan collated row per sample, no `segments`."""
    from eyas.recipe import TrainSection

    lengths = [5, 9, 3, 7, 4, 8, 6, 2]
    source = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long)} for n in lengths]
    groups = [list(range(8))]
    packing = Packing.from_train(TrainSection(batch_tokens=20, max_batch_size=3))
    assert not packing.packed
    stream = BatchStream(source, lengths, groups, packing, position=DataPosition())
    plan = plan_epoch(lengths, groups, 20, 3, seed=0, epoch=0, multiple_of=1)
    for indices in plan:
        batch = next(stream)
        expected = collate([source[i] for i in indices], 0, packing.pad_to_multiple_of)
        assert "segments" not in batch and batch["index"].tolist() == indices
        assert all(torch.equal(batch[k], expected[k]) for k in expected)
