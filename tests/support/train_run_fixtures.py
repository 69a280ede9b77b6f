"""Helpers shared by the training tests: a tiny prepared run directory (conversations ->
prepare -> optional feature capture) on a tiny random target."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the cat sat on a mat while two dogs ran past seven red cars near an old tall tree "
    "and then it rained so every bird flew home quickly"
).split()


def write_conversations(path: Path, n: int = 24, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
            f.write(
                json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
                + "\n"
            )
    return path


def tiny_recipe(run_dir: Path, target_dir: Path, features: str = "offline", **train):
    """A recipe for a tiny run: draft vocab 64, TTT 3, small batches."""
    from eyas.recipe import recipe_from_dict

    tree = {
        "name": "tiny",
        "run_dir": str(run_dir),
        "target": {"name_or_path": str(target_dir), "dtype": "float32", "device": "cpu"},
        "data": {
            "sources": [str(run_dir.parent / "conversations.jsonl")],
            "features": features,
            "eval_fraction": 0.15,
            "max_length": 512,
            "shard_tokens": 1024,
            "capture_batch_tokens": 512,
        },
        "head": {"draft_vocab_size": 64},
        "train": {
            "batch_tokens": 512,
            "max_batch_size": 8,
            "eagle3": {"ttt_steps": 3},
            "warmup_steps": 2,
            "log_every": 1,
            "eval_every": 4,
            "save_every": 4,
            "learning_rate": 3e-3,
            "logger": "jsonl",
            "mixed_precision": "no",
            "cpu_threads": 1,
            **train,
        },
    }
    return recipe_from_dict(tree)


def prepare_run(tmp: Path, target_dir: Path, features: str = "offline", n: int = 24, **train):
    """Write conversations, prepare them and (offline) capture features; return the recipe."""
    from eyas.data.prepare import prepare

    tmp.mkdir(parents=True, exist_ok=True)
    write_conversations(tmp / "conversations.jsonl", n)
    recipe = tiny_recipe(tmp / "run", target_dir, features, **train)
    prepare(recipe, progress=False)
    if features == "offline":
        from eyas.data.capture import capture

        capture(recipe, progress=False)
    return recipe


def captured_in_shards(tmp: Path, target_dir: Path, n: int = 12, **train):
    """A run prepared and captured by `eyas capture` into several small shards (200 tokens
    each); returns (recipe, path of its recipe file)."""
    import yaml

    from eyas.cli import main
    from eyas.recipe import recipe_from_dict

    recipe = prepare_run(tmp, target_dir, "online", n=n, **train)
    tree = recipe.model_dump(mode="json")
    tree["data"].update(features="offline", shard_tokens=200)
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["capture", "--no-progress", "-r", str(path)]) == 0
    return recipe_from_dict(tree), path
