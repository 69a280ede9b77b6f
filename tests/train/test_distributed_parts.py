"""The pieces of distributed training that run in one process (design §2.8): a micro-batch
has one place in the epoch at any process count, the target loads whole under a ZeRO-3
config, and resumed logs continue their run. The launches themselves:
tests/train/test_train_sharded.py (slow)."""

from __future__ import annotations

import json

import pytest

from eyas.train.batching import BatchStream, Packing
from eyas.train.loop import micro_batch_seed
from eyas.train.metrics import make_logger


def _stream(rank: int, world: int, accum: int) -> BatchStream:
    lengths = [3 + (i * 7) % 11 for i in range(40)]
    source = [{"input_ids": [1] * n, "loss_mask": [1] * n} for n in lengths]
    packing = Packing(batch_tokens=24, max_batch_size=4, seed=5, multiple_of=accum)
    return BatchStream(source, lengths, [list(range(40))], packing, rank=rank, world=world)


def test_two_ranks_draw_the_micro_batches_and_seeds_of_one_process_with_accumulation():
    one = _stream(0, 1, 2)
    ranks = [_stream(r, 2, 1) for r in (0, 1)]
    for _ in range(12):  # past an epoch's end
        for r in ranks:
            mine, theirs = next(one), next(r)
            assert mine["index"].tolist() == theirs["index"].tolist()
            assert one.last_index == r.last_index
            assert micro_batch_seed(5, *one.last_index) == micro_batch_seed(5, *r.last_index)
    assert one.position == ranks[0].position == ranks[1].position


def test_micro_batch_seeds_differ_between_batches_and_epochs():
    seeds = {micro_batch_seed(0, e, i) for e in range(3) for i in range(50)}
    assert len(seeds) == 150


def test_the_target_loads_whole_under_a_zero3_config():
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from eyas.train.distributed import whole_target_loading

    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with whole_target_loading():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
    finally:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del keep


def test_a_resumed_jsonl_log_drops_what_the_killed_run_logged_after_its_checkpoint(tmp_path):
    first = make_logger("jsonl", tmp_path)
    for step in range(1, 8):
        first.log({"train/loss": float(step)}, step)
    first.close()  # killed after step 7; its last checkpoint is step 4
    resumed = make_logger("jsonl", tmp_path, resume_step=4)
    for step in range(5, 9):
        resumed.log({"train/loss": 10.0 + step}, step)
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["train/loss"] for r in rows][4:] == [15.0, 16.0, 17.0, 18.0]


def test_a_resumed_tensorboard_run_hides_the_steps_logged_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = make_logger("tensorboard", tmp_path)
    for step in range(1, 8):
        first.log({"train/loss": float(step)}, step)
    first.close()
    resumed = make_logger("tensorboard", tmp_path, resume_step=4)
    for step in range(5, 9):
        resumed.log({"train/loss": 10.0 + step}, step)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 9))
    assert [e.value for e in events][4:] == [15.0, 16.0, 17.0, 18.0]


def test_a_build_lock_a_killed_build_left_is_named_before_deepspeed_builds(tmp_path, monkeypatch, caplog):
    """torch's JIT build waits forever on a `lock` left in the extension's directory; a
    DeepSpeed launch names each one old enough to be a killed build's, and not a fresh one
    (another rank building right now)."""
    import logging
    import os
    import time

    from eyas.train.distributed import STALE_LOCK_SECONDS, make_accelerator, stale_extension_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = tmp_path / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "py311_cpu" / "other_op" / "lock"  # torch's default layout, one level deeper
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    stamp = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(old, (stamp, stamp))
    assert [p for p, _ in stale_extension_locks()] == [old]
    os.utime(fresh, (stamp, stamp))
    assert {p for p, _ in stale_extension_locks()} == {old, fresh}

    class Recipe:  # make_accelerator stops at the first thing it reads from the recipe
        @property
        def target(self):
            raise RuntimeError("stop")

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with (
        caplog.at_level(logging.WARNING, logger="eyas.train.distributed"),
        pytest.raises(RuntimeError, match="stop"),
    ):
        make_accelerator(Recipe())
    assert str(old) in caplog.text and "delete it" in caplog.text
