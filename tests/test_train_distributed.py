"""`accelerate launch` with 2 CPU processes: DDP over gloo, and DeepSpeed ZeRO-2 (CPU
accelerator, gloo). Slow: each launch starts two interpreters and a process group."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_run_fixtures import prepare_run

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_llama_dir):
    return prepare_run(
        tmp_path_factory.mktemp("dist"),
        tiny_llama_dir,
        "online",
        n=48,
        max_steps=4,
        save_every=2,
        eval_every=2,
        batch_tokens=256,
        max_batch_size=4,
    )


def _run(prepared, tmp_path, launcher_args, env=None):
    tree = prepared.model_dump(mode="json")
    tree["run_dir"] = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    os.symlink(prepared.paths.prepared, tmp_path / "run" / "prepared")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    cmd = [*ACCELERATE, *launcher_args, "-m", "eyas.train", "--recipe", str(recipe), "--no-progress"]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return tmp_path / "run", out


def _check(run_dir, out, kind):
    assert f"training on 2 process(es), {kind}" in out
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "final" / "head.safetensors").is_file()
    assert (ckpts / "step-00000004" / "rng-rank1.safetensors").is_file()
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert '"step": 4' in metrics


@pytest.mark.slow
def test_ddp_two_cpu_processes(prepared, tmp_path):
    run_dir, out = _run(
        prepared,
        tmp_path,
        ["--config_file", str(REPO / "recipes/accelerate/ddp.yaml"), "--num_processes", "2"],
    )
    _check(run_dir, out, "MULTI_CPU")


@pytest.mark.slow
def test_deepspeed_zero2_two_cpu_processes(prepared, tmp_path):
    pytest.importorskip("deepspeed")
    run_dir, out = _run(
        prepared,
        tmp_path,
        ["--config_file", str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"), "--num_processes", "2"],
        env={"DS_ACCELERATOR": "cpu"},
    )
    _check(run_dir, out, "DEEPSPEED")
    assert (run_dir / "checkpoints" / "step-00000004" / "accelerate").is_dir()
    # nothing eyas hands accelerate is pickled: the scheduler state lives in state.json
    assert not list((run_dir / "checkpoints").rglob("custom_checkpoint_*.pkl"))
    # a run killed after step 2 resumes there under ZeRO-2 and reaches the same end
    import shutil

    for name in ("final", "step-00000004"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    cmd = [
        *ACCELERATE,
        "--config_file",
        str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"),
        "--num_processes",
        "2",
        "-m",
        "eyas.train",
        "--recipe",
        str(tmp_path / "r.yaml"),
        "--no-progress",
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        "step-00000002 (step 2)" in out and (run_dir / "checkpoints" / "final" / "head.safetensors").is_file()
    )
