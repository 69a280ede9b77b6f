"""P-EAGLE through the training loop and its recipes: the shipped recipes are valid P-EAGLE
runs, and a P-EAGLE run killed with SIGKILL and resumed ends with the weights of an
uninterrupted one (COD sampling draws from the checkpointed generator)."""

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
PEAGLE_RECIPES = sorted((REPO / "recipes").glob("*-peagle*.yaml"))


def test_every_peagle_recipe_ships():
    names = {p.name for p in PEAGLE_RECIPES}
    assert names == {
        "smollm2-135m-peagle.yaml",
        "smollm2-135m-peagle-long.yaml",
        "gpt-oss-20b-peagle.yaml",
        "gpt-oss-120b-peagle.yaml",
        "qwen3-coder-30b-a3b-peagle.yaml",
    }


@pytest.mark.parametrize("path", PEAGLE_RECIPES, ids=lambda p: p.stem)
def test_peagle_recipe_is_a_valid_peagle_run(path):
    from eyas.recipe import load_recipe

    recipe = load_recipe(path)
    assert recipe.head.algorithm == "peagle"
    if recipe.train.init_from:  # the quickstart's: the EAGLE-3 head's one layer, K = 5
        assert recipe.head.num_layers == 1 and recipe.train.section("peagle").num_depths == 5
    else:
        assert 2 <= recipe.head.num_layers <= 4
        assert 8 <= recipe.train.section("peagle").num_depths <= 10
    # a served K deeper than the trained depths would draft from untrained mask slots
    assert recipe.head.speculative_tokens <= recipe.train.section("peagle").num_depths
    assert 0 < recipe.train.section("peagle").cod_r_min <= recipe.train.section("peagle").cod_r < 1
    head_lines = path.read_text().splitlines()[:4]
    assert any("accelerate launch" in line and str(path.relative_to(REPO)) in line for line in head_lines)


def _launch(recipe_path: Path):
    return subprocess.Popen(
        [sys.executable, "-m", "eyas.train", "--recipe", str(recipe_path), "--no-progress"],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_peagle_sigkill_then_resume_matches_uninterrupted_run(tmp_path, tiny_llama_dir):
    base = prepare_run(tmp_path / "prep", tiny_llama_dir, "online", n=24)
    total = 24
    recipes = {}
    for name in ("straight", "killed"):
        tree = base.model_dump(mode="json")
        tree["run_dir"] = str(tmp_path / name)
        tree["head"].update(algorithm="peagle", num_layers=2)
        # segments of 8 anchors: the checkpointed multi-segment path runs too
        tree["train"].update(
            max_steps=total,
            save_every=3,
            eval_every=0,
            log_every=5,
            peagle={"num_depths": 3, "cod_r": 0.7, "cod_r_min": 0.2, "segment_length": 8},
        )
        tree["train"].pop("eagle3", None)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        run = Path(tree["run_dir"])
        run.mkdir()
        os.symlink(base.paths.prepared, run / "prepared")
        recipes[name] = (run, path)

    straight = _launch(recipes["straight"][1])
    out, _ = straight.communicate(timeout=900)
    assert straight.returncode == 0, out

    run, path = recipes["killed"]
    proc = _launch(path)
    deadline = time.time() + 600
    while not (run / "checkpoints" / "step-00000006").is_dir():
        assert proc.poll() is None and time.time() < deadline, (
            proc.stdout.read() if proc.poll() is not None else ""
        )
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "final").exists(), "the run finished before the kill; make it longer"
    resumed = _launch(path)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    assert "resumed from" in out

    a = load_file(str(recipes["straight"][0] / "checkpoints" / "final" / "head.safetensors"))
    b = load_file(str(run / "checkpoints" / "final" / "head.safetensors"))
    assert "mask_hidden" in a and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
