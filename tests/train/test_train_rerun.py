"""Reruns never mix two runs in one head: a finished run is left as it is, a changed
recipe is refused naming the keys (unless --accept-changes / --restart), and a cache of
other prepared data than the run holds is refused by train and named by capture --verify."""

import json
import shutil

import pytest
import yaml
from support.train_run_fixtures import captured_in_shards, prepare_run, write_conversations

from eyas.cli import main


def _recipe_file(recipe, path):
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    return str(path)


def _train(path, *extra):
    return main(["train", "--no-progress", "-r", path, *extra])


def _last_line(capsys):
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    return (err[-1] if err else ""), captured


def _snapshot(run_dir):
    """Bytes of what a trained run holds for export and the card."""
    files = [run_dir / "recipe.yaml", *sorted((run_dir / "checkpoints").rglob("*"))]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file()}


@pytest.fixture
def finished(tmp_path, tiny_llama_dir, capsys):
    recipe = prepare_run(tmp_path, tiny_llama_dir, "online", n=12, max_steps=4, save_every=2, eval_every=0)
    path = _recipe_file(recipe, tmp_path / "r.yaml")
    assert _train(path) == 0
    capsys.readouterr()
    return recipe, path


def test_a_finished_run_rerun_does_nothing(finished, capsys):
    recipe, path = finished
    before = _snapshot(recipe.paths.root)
    assert _train(path) == 0
    out = capsys.readouterr().out
    assert "finished training at step 4; nothing to do" in out
    assert _snapshot(recipe.paths.root) == before


def test_a_finished_run_under_a_changed_recipe_is_refused_and_left_as_it_was(finished, capsys):
    recipe, path = finished
    before = _snapshot(recipe.paths.root)
    assert _train(path, "train.learning_rate=1e-4", "head.num_layers=2") == 1
    line, captured = _last_line(capsys)
    assert "Traceback" not in captured.err
    assert line.startswith("eyas train: ") and "finished training (4 steps)" in line
    assert "train.learning_rate: 0.003 -> 0.0001" in line and "head.num_layers: 1 -> 2" in line
    assert "--restart" in line
    # the recipe, checkpoints and head still say what the head was trained with
    assert _snapshot(recipe.paths.root) == before
    # what only watches the run may change freely
    assert _train(path, "train.log_every=3", "train.eval_every=7") == 0
    assert "nothing to do" in capsys.readouterr().out


def test_restart_trains_anew_under_the_new_recipe(finished, capsys):
    recipe, path = finished
    assert _train(path, "train.learning_rate=1e-4", "--restart") == 0
    assert "trained 4 steps" in capsys.readouterr().out
    saved = yaml.safe_load((recipe.paths.root / "recipe.yaml").read_text())
    assert saved["train"]["learning_rate"] == 1e-4
    steps = [
        json.loads(x)["step"]
        for x in (recipe.paths.root / "metrics.jsonl").read_text().splitlines()
        if "train/loss" in x
    ]
    assert steps == [1, 2, 3, 4]  # the earlier run's metrics are gone, not appended to
    state = json.loads((recipe.paths.checkpoints / "step-00000004" / "state.json").read_text())
    assert state["settings"]["train.learning_rate"] == 1e-4 and state["changes"] == []


def test_training_a_finished_run_on_needs_accept_changes(finished, capsys):
    recipe, path = finished
    assert _train(path, "train.max_steps=6") == 1
    line, _ = _last_line(capsys)
    assert "train.max_steps: 4 -> 6" in line
    assert _train(path, "train.max_steps=6", "--accept-changes") == 0
    assert "trained 6 steps" in capsys.readouterr().out
    state = json.loads((recipe.paths.checkpoints / "step-00000006" / "state.json").read_text())
    assert state["changes"] == [{"step": 4, "changes": ["train.max_steps: 4 -> 6"]}]
    assert yaml.safe_load((recipe.paths.root / "recipe.yaml").read_text())["train"]["max_steps"] == 6
    # a change that leaves nothing to train is refused even when accepted
    assert _train(path, "train.max_steps=6", "train.learning_rate=1e-4", "--accept-changes") == 1
    line, _ = _last_line(capsys)
    assert "nothing is left to train" in line


def test_a_partly_trained_run_resumed_under_changed_settings_is_refused(finished, capsys):
    recipe, path = finished
    # as if killed after the step-2 checkpoint
    shutil.rmtree(recipe.paths.checkpoints / "step-00000004")
    shutil.rmtree(recipe.paths.checkpoints / "final")
    assert _train(path, "train.warmup_steps=1") == 1
    line, _ = _last_line(capsys)
    assert "step-00000002 was trained under other settings" in line and "train.warmup_steps: 2 -> 1" in line
    assert "--accept-changes" in line
    assert not (recipe.paths.checkpoints / "final").exists()
    assert _train(path, "train.warmup_steps=1", "--accept-changes") == 0
    state = json.loads((recipe.paths.checkpoints / "step-00000004" / "state.json").read_text())
    assert state["changes"] == [{"step": 2, "changes": ["train.warmup_steps: 2 -> 1"]}]


def test_resume_false_never_mixes_with_an_earlier_runs_checkpoints(finished, capsys):
    recipe, path = finished
    assert _train(path, "train.resume=false") == 1
    line, _ = _last_line(capsys)
    assert "holds checkpoints of an earlier run" in line and "--restart" in line


def test_online_training_after_preparing_other_data_is_refused(finished, capsys):
    recipe, path = finished
    from eyas.data.prepare import prepare

    write_conversations(recipe.paths.root.parent / "conversations.jsonl", n=12, seed=7)
    prepare(recipe, progress=False)
    assert _train(path) == 1
    line, _ = _last_line(capsys)
    assert "the prepared data (run `eyas prepare` again since?)" in line


def test_a_cache_of_other_prepared_data_is_refused_and_named(tmp_path, tiny_llama_dir, capsys):
    recipe = prepare_run(tmp_path, tiny_llama_dir, "online", n=12, max_steps=2, save_every=0, eval_every=0)
    tree = recipe.model_dump(mode="json")
    tree["data"]["features"] = "offline"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["capture", "--no-progress", "-r", str(path)]) == 0
    assert main(["capture", "--verify", "-r", str(path)]) == 0
    # the data is prepared again, from other conversations; the cache is not recaptured
    from eyas.data.prepare import prepare
    from eyas.recipe import load_recipe

    write_conversations(tmp_path / "conversations.jsonl", n=12, seed=7)
    prepare(load_recipe(str(path)), progress=False)
    capsys.readouterr()
    assert main(["train", "--no-progress", "-r", str(path)]) == 1
    line, captured = _last_line(capsys)
    cache_train = recipe.paths.cache / "train"
    assert "Traceback" not in captured.err
    assert f"{cache_train}: captured from other prepared data" in line and "eyas capture --overwrite" in line
    assert not (recipe.paths.checkpoints / "final").exists()
    assert main(["capture", "--verify", "-r", str(path)]) == 1
    assert f"{cache_train}: captured from other prepared data" in capsys.readouterr().out
    # capture itself will not mix the two; --overwrite recaptures, and training goes on
    assert main(["capture", "--no-progress", "-r", str(path)]) == 1
    assert "other data or settings" in capsys.readouterr().err
    assert main(["capture", "--no-progress", "--overwrite", "-r", str(path)]) == 0
    assert main(["capture", "--verify", "-r", str(path)]) == 0
    assert main(["train", "--no-progress", "-r", str(path)]) == 0


def test_training_on_a_capture_that_never_finished_is_one_line(tmp_path, tiny_llama_dir, capsys):
    """A killed capture leaves a manifest that is not complete: `eyas train` says so in one
    line naming the cache and `eyas capture` (no traceback); the capture rerun resumes it."""
    recipe, path = captured_in_shards(tmp_path, tiny_llama_dir, max_steps=2, save_every=0, eval_every=0)
    split_dir = recipe.paths.cache / "train"
    manifest = json.loads((split_dir / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 2
    for shard in manifest["shards"][1:]:  # what a kill after the first shard leaves
        (split_dir / shard["file"]).unlink()
    cut = {**manifest, "complete": False, "shards": manifest["shards"][:1]}
    (split_dir / "manifest.json").write_text(json.dumps(cut))
    capsys.readouterr()
    assert main(["train", "--no-progress", "-r", str(path)]) == 1
    line, captured = _last_line(capsys)
    assert "Traceback" not in captured.err
    assert line == f"eyas train: {split_dir}: capture incomplete; rerun `eyas capture` to resume it"
    assert main(["capture", "--no-progress", "-r", str(path)]) == 0
    assert json.loads((split_dir / "manifest.json").read_text()) == manifest
    assert main(["train", "--no-progress", "-r", str(path)]) == 0
