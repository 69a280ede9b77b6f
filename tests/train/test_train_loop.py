"""The training loop on a tiny target: it learns, resumes bit-exactly after SIGKILL, stops on
repeated non-finite losses, and writes the final head `eyas export` reads."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support.train_run_fixtures import prepare_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def online_run(tmp_path_factory, tiny_llama_dir):
    return prepare_run(tmp_path_factory.mktemp("online"), tiny_llama_dir, "online", n=24)


def _with(recipe, run_dir, **train):
    tree = recipe.model_dump(mode="json")
    tree["run_dir"] = str(run_dir)
    tree["train"].update(train)
    from eyas.recipe import recipe_from_dict

    return recipe_from_dict(tree)


def _link_prepared(src_recipe, dst_recipe):
    dst_recipe.paths.root.mkdir(parents=True, exist_ok=True)
    os.symlink(src_recipe.paths.prepared, dst_recipe.paths.prepared)


def test_overfits_one_batch(tmp_path, tiny_llama_dir):
    """One short conversation, the full target vocabulary: step-0 accuracy goes past 0.9."""
    recipe = prepare_run(
        tmp_path,
        tiny_llama_dir,
        "online",
        n=2,
        max_steps=80,
        learning_rate=3e-3,
        warmup_steps=5,
        eval_every=0,
        save_every=0,
        log_every=1,
    )
    tree = recipe.model_dump(mode="json")
    tree["head"]["draft_vocab_size"] = 320
    tree["data"]["eval_fraction"] = 0.5  # one train row, one eval row
    from eyas.data.prepare import prepare
    from eyas.recipe import recipe_from_dict
    from eyas.train.loop import train

    recipe = recipe_from_dict(tree)
    prepare(recipe, progress=False)
    summary = train(recipe, progress=False)
    first = json.loads((recipe.paths.root / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    assert summary["train"]["train/acc_0"] > 0.9 > first["train/acc_0"]


def test_offline_run_writes_final_head_and_metrics(tmp_path, tiny_llama_dir):
    recipe = prepare_run(
        tmp_path, tiny_llama_dir, "offline", n=24, max_steps=6, save_every=2, keep_checkpoints=2
    )
    from eyas.heads.io import load_head
    from eyas.train.loop import train

    summary = train(recipe, progress=False)
    ckpts = sorted(p.name for p in recipe.paths.checkpoints.iterdir())
    assert ckpts == ["final", "step-00000004", "step-00000006"]  # keep_checkpoints=2
    assert (recipe.paths.root / "recipe.yaml").is_file()
    lines = [json.loads(x) for x in (recipe.paths.root / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accept_len" in x for x in lines) and any("train/acc_2" in x for x in lines)
    assert summary["step"] == 6
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), "float32", "cpu")
    head = load_head(recipe.paths.checkpoints / "final", target.model.get_input_embeddings().weight)
    assert head.config.draft_vocab_size == 64 and head.config.aux_layer_ids == [2, 4, 5]
    # the vocabulary map holds the most frequent masked tokens
    freqs = load_file(str(recipe.paths.prepared / "token_freqs.safetensors"))["freqs"]
    assert freqs[head.draft_token_ids()].min() >= freqs[~head.t2d.cpu()[: freqs.numel()]].max()


def test_repeated_nonfinite_losses_stop_with_checkpoint(online_run, tmp_path, monkeypatch):
    import eyas.train.loop as loop

    def nan_loss(head, batch, labels, cfg, generator=None):
        from eyas.train.reference import ttt_loss

        stats = ttt_loss(
            head, batch, labels, cfg.section("eagle3").ttt_steps, cfg.section("eagle3").ttt_decay
        )
        stats.loss = stats.loss * float("nan")
        return stats

    from eyas.heads.algorithms import Algorithm

    monkeypatch.setattr(Algorithm, "loss_function", lambda self: nan_loss)
    recipe = _with(online_run, tmp_path / "run", max_steps=20, max_nonfinite_steps=2, save_every=0)
    _link_prepared(online_run, recipe)
    with pytest.raises(loop.TrainingStopped, match="non-finite"):
        loop.train(recipe, progress=False)
    ckpts = [p.name for p in recipe.paths.checkpoints.iterdir()]
    assert ckpts == ["step-00000003"]


def test_max_minutes_stops_with_the_head_saved_and_a_rerun_resumes(online_run, tmp_path, monkeypatch):
    """train.max_minutes ends the run after the step in progress: its checkpoint and final
    head are saved, the run is not finished, and a rerun without the limit (an operational
    key: the same run) resumes from there to the last step."""
    import eyas.train.loop as loop

    real_step = loop.train_step

    def slow_step(run):  # a step of a second at least: 20 of them outlast the 3 s limit
        time.sleep(1.0)
        return real_step(run)

    monkeypatch.setattr(loop, "train_step", slow_step)
    recipe = _with(online_run, tmp_path / "run", max_steps=20, max_minutes=0.05, save_every=0)
    _link_prepared(online_run, recipe)
    summary = loop.train(recipe, progress=False)
    stopped = summary["step"]
    assert summary["stopped_at_deadline"] and 1 <= stopped < 20
    assert sorted(p.name for p in recipe.paths.checkpoints.iterdir()) == ["final", f"step-{stopped:08d}"]
    monkeypatch.setattr(loop, "train_step", real_step)
    resumed = loop.train(_with(online_run, tmp_path / "run", max_steps=20, save_every=0), progress=False)
    assert resumed["step"] == 20 and not resumed["stopped_at_deadline"]
    assert not resumed.get("already_finished")


def _launch(recipe_path: Path, extra=(), env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "eyas.train", "--recipe", str(recipe_path), "--no-progress", *extra],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(online_run, tmp_path):
    """A run killed with SIGKILL after a checkpoint and rerun ends with exactly the weights of
    an uninterrupted run (CPU, fixed seed)."""
    total = 60
    recipes = {}
    for name in ("straight", "killed"):
        r = _with(online_run, tmp_path / name, max_steps=total, save_every=3, eval_every=0, log_every=5)
        _link_prepared(online_run, r)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(r.model_dump(mode="json")))
        recipes[name] = (r, path)

    straight = _launch(recipes["straight"][1])
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out

    r, path = recipes["killed"]
    proc = _launch(path)
    deadline = time.time() + 300
    while not (r.paths.checkpoints / "step-00000006").is_dir():
        assert proc.poll() is None and time.time() < deadline, (
            proc.stdout.read() if proc.poll() is not None else ""
        )
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (r.paths.checkpoints / "final").exists(), "the run finished before the kill; make it longer"
    resumed = _launch(path)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resumed from" in out

    a = load_file(str(recipes["straight"][0].paths.checkpoints / "final" / "head.safetensors"))
    b = load_file(str(r.paths.checkpoints / "final" / "head.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ckpt_a = load_file(
        str(recipes["straight"][0].paths.checkpoints / f"step-{total:08d}" / "model.safetensors")
    )
    assert all(torch.equal(ckpt_a[k], a[k]) for k in a)


def test_frozen_lm_head_keeps_the_targets_rows(tmp_path, tiny_llama_dir):
    recipe = prepare_run(
        tmp_path, tiny_llama_dir, "online", n=12, max_steps=3, save_every=0, eval_every=0, freeze_lm_head=True
    )
    from eyas.heads.io import load_head
    from eyas.target.features import target_norm_and_lm_head
    from eyas.target.load import load_target
    from eyas.train.loop import train

    train(recipe, progress=False)
    target = load_target(str(tiny_llama_dir), "float32", "cpu")
    head = load_head(recipe.paths.checkpoints / "final", target.model.get_input_embeddings().weight)
    _, lm_head = target_norm_and_lm_head(target.model)
    assert torch.equal(head.lm_head.weight, lm_head.weight[head.draft_token_ids()])
    # without the flag the same run moves those rows
    free = prepare_run(
        tmp_path / "free", tiny_llama_dir, "online", n=12, max_steps=3, save_every=0, eval_every=0
    )
    train(free, progress=False)
    moved = load_head(free.paths.checkpoints / "final", target.model.get_input_embeddings().weight)
    assert not torch.equal(moved.lm_head.weight, lm_head.weight[moved.draft_token_ids()])
