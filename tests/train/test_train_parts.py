"""Batching, schedule, metrics and the algorithm registry."""

import os

import pytest
import torch

from eyas.heads.algorithms import get_algorithm
from eyas.train.batching import BatchStream, DataPosition, Packing, collate, pack_group, plan_epoch
from eyas.train.checkpoint import latest_checkpoint, list_checkpoints
from eyas.train.eagle3 import eagle3_loss
from eyas.train.metrics import AccuracyMeter
from eyas.train.run_setup import cosine_with_warmup
from eyas.train.step_stats import StepStats


def test_pack_group_fits_token_budget_and_batch_size():
    lengths = [5, 50, 17, 33, 8, 8, 120, 64, 2, 40]
    batches = pack_group(range(len(lengths)), lengths, batch_tokens=100, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 100


def _stream(position=None, rank=0, world=1):
    lengths = [3 + (7 * i) % 29 for i in range(40)]
    source = [{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in lengths]
    groups = [list(range(0, 20)), list(range(20, 40))]
    return BatchStream(
        source,
        lengths,
        groups,
        Packing(batch_tokens=64, max_batch_size=4, seed=3),
        rank=rank,
        world=world,
        position=position,
    )


def test_stream_batches_name_their_samples():
    stream = _stream()
    source = stream.source
    for _ in range(5):
        batch = next(stream)
        for row, i in enumerate(batch["index"].tolist()):
            n = len(source[i]["input_ids"])
            assert batch["input_ids"][row, :n].tolist() == source[i]["input_ids"]
            assert int(batch["attention_mask"][row].sum()) == n


def test_plan_is_deterministic_per_seed_and_epoch():
    lengths = [3 + (7 * i) % 29 for i in range(40)]
    groups = [list(range(40))]
    a = plan_epoch(lengths, groups, 64, 4, seed=1, epoch=0)
    assert a == plan_epoch(lengths, groups, 64, 4, seed=1, epoch=0)
    assert a != plan_epoch(lengths, groups, 64, 4, seed=1, epoch=1)
    assert a != plan_epoch(lengths, groups, 64, 4, seed=2, epoch=0)


def test_stream_resumes_from_position_across_epochs():
    full = _stream()
    n = full.batches_per_epoch()
    seen = [next(full)["input_ids"] for _ in range(n + 5)]
    resumed = _stream(DataPosition(epoch=0, batches=n - 2))
    rest = [next(resumed)["input_ids"] for _ in range(7)]
    for x, y in zip(seen[n - 2 :], rest):
        assert torch.equal(x, y)
    assert resumed.position.epoch == 1


def test_ranks_take_disjoint_batches():
    r0, r1 = _stream(rank=0, world=2), _stream(rank=1, world=2)
    assert r0.batches_per_epoch() % 2 == 0
    a = [next(r0) for _ in range(3)]
    b = [next(r1) for _ in range(3)]
    assert all(
        not torch.equal(x["input_ids"], y["input_ids"]) or x["input_ids"].shape != y["input_ids"].shape
        for x, y in zip(a, b)
    )
    assert r0.position == r1.position == DataPosition(0, 6)


def test_collate_pads_right():
    out = collate(
        [
            {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "aux": torch.ones(3, 4)},
            {"input_ids": [4], "loss_mask": [1], "aux": torch.ones(1, 4)},
        ],
        pad_id=9,
    )
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert out["aux"][1, 1:].abs().sum() == 0


def test_cosine_schedule_warms_up_then_decays_to_zero():
    f = cosine_with_warmup(4, 20)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(12) == pytest.approx(0.5) and f(20) == pytest.approx(0.0)


def test_meter_accept_length_from_per_step_accuracy():
    m = AccuracyMeter()
    m.add(StepStats(loss=torch.tensor(2.0), hits=[8, 4], counts=[10, 10], tokens=20))
    m.add(StepStats(loss=torch.tensor(4.0), hits=[0, 2], counts=[0, 10], tokens=20))
    s = m.summary("x/")
    assert s["x/acc_0"] == 0.8 and s["x/acc_1"] == 0.3 and s["x/loss"] == 3.0
    assert s["x/accept_len"] == pytest.approx(1 + 0.8 + 0.8 * 0.3)


def test_meter_reports_named_loss_terms_as_batch_means():
    m = AccuracyMeter()
    m.add(
        StepStats(
            loss=torch.tensor(5.0), hits=[1], counts=[2], tokens=4, extra_losses={"copy_attention_loss": 1.0}
        )
    )
    m.add(
        StepStats(
            loss=torch.tensor(7.0), hits=[1], counts=[2], tokens=4, extra_losses={"copy_attention_loss": 3.0}
        )
    )
    s = m.summary("train/")
    assert s["train/copy_attention_loss"] == 2.0 and s["train/loss"] == 6.0
    m.reset()
    m.add(StepStats(loss=torch.tensor(1.0), hits=[1], counts=[2], tokens=4))
    assert "train/copy_attention_loss" not in m.summary("train/")


def test_registry():
    assert get_algorithm("eagle3").loss_function() is eagle3_loss
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        get_algorithm("nope").loss_function()


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / "state.json").write_text("{}")
    (tmp_path / "step-00000004").mkdir()  # killed before state.json: incomplete
    (tmp_path / ".tmp-step-00000006").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def test_a_draft_vocabulary_above_the_targets_is_named_not_silently_clamped(tiny_llama_dir, caplog):
    from transformers import AutoConfig

    from eyas.recipe import recipe_from_dict
    from eyas.train.build import head_config_for

    target_config = AutoConfig.from_pretrained(tiny_llama_dir)
    vocab = target_config.vocab_size
    config = head_config_for(recipe_from_dict({"head": {"draft_vocab_size": vocab + 1000}}), target_config)
    assert config.draft_vocab_size == vocab and not config.uses_vocab_map
    assert f"head.draft_vocab_size {vocab + 1000} is above the target's vocabulary ({vocab})" in caplog.text
    caplog.clear()
    assert head_config_for(
        recipe_from_dict({"head": {"draft_vocab_size": vocab // 2}}), target_config
    ).uses_vocab_map
    assert "above the target's vocabulary" not in caplog.text


class _Payload:
    """Unpickled without weights_only, it would run a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_engine_checkpoints_load_without_unpickling(tmp_path):
    """Resuming under DeepSpeed goes through its checkpoint engine, which asks torch.load for
    weights_only=False: eyas loads those files with weights_only=True all the same."""
    import types

    from eyas.train.checkpoint import TrainerState, UnsafeCheckpointError, load_checkpoint

    ckpt = tmp_path / "step-00000002"
    (ckpt / "accelerate").mkdir(parents=True)
    (ckpt / "state.json").write_text(TrainerState(step=2).to_json())
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Payload(marker)}, ckpt / "accelerate" / "evil.pt")
    torch.save({"zero_stage": 2, "state": {"exp_avg": torch.ones(3)}}, ckpt / "accelerate" / "plain.pt")
    loaded = {}

    def load_state(path):  # what DeepSpeed's TorchCheckpointEngine.load does
        for name in sorted(os.listdir(path)):
            loaded[name] = torch.load(os.path.join(path, name), map_location="cpu", weights_only=False)

    accelerator = types.SimpleNamespace(
        distributed_type=types.SimpleNamespace(name="DEEPSPEED"), load_state=load_state, process_index=0
    )
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt: holds the type posix\.system"):
        load_checkpoint(ckpt, accelerator, None, None)
    assert not marker.exists()
    (ckpt / "accelerate" / "evil.pt").unlink()
    assert load_checkpoint(ckpt, accelerator, None, None).step == 2
    assert torch.equal(loaded["plain.pt"]["state"]["exp_avg"], torch.ones(3))
    assert torch.load is torch.serialization.load  # put back


def test_deepspeed_checkpoint_types_are_importable():
    """The names allowed for DeepSpeed's files exist in the installed DeepSpeed (a rename
    would make every ZeRO resume fail)."""
    pytest.importorskip("deepspeed")
    from eyas.train.checkpoint import DEEPSPEED_CHECKPOINT_TYPES, _allowed_engine_types

    assert len(_allowed_engine_types()) == len(DEEPSPEED_CHECKPOINT_TYPES)


def test_an_optimizer_state_for_other_parameters_is_named_on_resume(tmp_path):
    import types

    from safetensors.torch import save_file

    from eyas.train.checkpoint import CheckpointMismatchError, TrainerState, load_checkpoint

    class Holder(torch.nn.Module):
        def __init__(self, trainable: int):
            super().__init__()
            self.head = torch.nn.ModuleDict({f"p{i}": torch.nn.Linear(2, 2, bias=False) for i in range(2)})
            for i, layer in enumerate(self.head.values()):
                layer.weight.requires_grad_(i < trainable)

    def adam(model):
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(TrainerState(step=2).to_json())
    before = Holder(trainable=2)  # the run that wrote it trained both tensors
    save_file(
        {k: v.contiguous() for k, v in before.head.state_dict().items()}, str(ckpt / "model.safetensors")
    )
    opt = adam(before)
    sum(p.sum() for p in before.parameters()).backward()
    opt.step()
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    accelerator = types.SimpleNamespace(
        distributed_type=types.SimpleNamespace(name="NO"), unwrap_model=lambda m: m, process_index=0
    )
    now = Holder(trainable=1)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer\.pt: its optimizer state .*--restart"):
        load_checkpoint(ckpt, accelerator, now, adam(now))
    same = Holder(trainable=2)
    assert load_checkpoint(ckpt, accelerator, same, adam(same)).step == 2
