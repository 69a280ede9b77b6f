"""An algorithm is one registered object (heads/algorithms.py, DESIGN §1): a third one,
registered here and nowhere else (this file plays its heads/<algo>.py and train/<algo>.py),
trains through `eyas.train`, exports, validates, gets a model card and loads back as its
own head class, with no stage's code knowing its name."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field
from support.train_run_fixtures import prepare_run

from eyas.heads import algorithms
from eyas.heads.algorithms import Algorithm, AlgorithmSection, get_algorithm, register
from eyas.heads.eagle3 import Eagle3Head


class ToyHead(Eagle3Head):
    """An EAGLE-3-shaped head under another name."""


class ToyTraining(AlgorithmSection):
    steps: int = Field(1, ge=1)


def toy_loss(head, batch, labels, train_cfg, generator=None):
    from eyas.train.fastpath import ttt_loss_valid_rows

    toy_loss.calls += 1
    steps = train_cfg.section("toy").steps
    return ttt_loss_valid_rows(head, batch, labels, steps, 1.0, train_cfg.compile_loss)


toy_loss.calls = 0

TOY = Algorithm(
    name="toy",
    head_class=ToyHead,
    training=ToyTraining,
    loss=toy_loss,
    speculators_architecture="ToySpeculator",
)


@pytest.fixture
def toy_registered():
    register(TOY)
    yield TOY
    algorithms._REGISTRY.pop("toy", None)


def test_shipped_algorithms_register_themselves():
    assert {"eagle3", "peagle"} <= set(algorithms.algorithm_names())
    assert get_algorithm("peagle").draft_passes(5) == 1
    assert get_algorithm("eagle3").draft_passes(5) == 5
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; known: eagle3, peagle"):
        get_algorithm("nope")


def test_a_name_means_one_algorithm(toy_registered):
    register(TOY)  # the same registration again is harmless
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register(Algorithm("toy", ToyHead, ToyTraining, toy_loss, "OtherSpeculator"))


def test_an_unregistered_algorithm_is_refused_by_the_recipe(tmp_path):
    from eyas.recipe import RecipeError, recipe_from_dict

    tree = {"name": "x", "run_dir": str(tmp_path), "target": {"name_or_path": "t"}}
    with pytest.raises(RecipeError, match="toy"):
        recipe_from_dict({**tree, "head": {"algorithm": "toy"}})


def test_a_registered_algorithm_trains_exports_and_loads(tmp_path, tiny_llama_dir, toy_registered):
    from eyas.export.hub import model_card
    from eyas.export.reader import export_config, load_any_head
    from eyas.export.validate import validate_export
    from eyas.export.writer import export_checkpoint
    from eyas.recipe import RecipeError, recipe_from_dict
    from eyas.train.loop import train

    base = prepare_run(tmp_path, tiny_llama_dir, "offline", n=16, max_steps=2, eval_every=0, save_every=0)
    tree = base.model_dump(mode="json")
    tree["head"]["algorithm"] = "toy"
    tree["train"].pop("eagle3")
    tree["train"]["toy"] = {"steps": 2}
    recipe = recipe_from_dict(tree)
    assert recipe.train.section("toy") == ToyTraining(steps=2)
    with pytest.raises(RecipeError, match="train.toy.nope"):
        recipe_from_dict({**tree, "train": {**tree["train"], "toy": {"nope": 1}}})

    toy_loss.calls = 0
    summary = train(recipe, progress=False)
    assert summary["step"] == 2
    assert toy_loss.calls >= 2  # the registered loss is the one that trained

    out = export_checkpoint(summary["final_dir"], tmp_path / "export")
    config = (out / "config.json").read_text()
    assert '"ToySpeculator"' in config and '"speculators_model_type": "toy"' in config
    cfg = export_config(out)
    head = load_any_head(out, target_embed=torch.zeros(cfg.vocab_size, cfg.target_hidden_size))
    assert type(head) is ToyHead and head.config.algorithm == "toy"
    assert validate_export(out) == []
    card = model_card(out, "me/toy-head")
    assert "A toy draft head" in card and "\n- toy\n" in card and "mask token" not in card


def test_no_stage_compares_an_algorithm_name():
    """What differs between algorithms is a field of their registration: outside their own
    files (heads/<algo>.py, train/<algo>.py) and the registry, no package module compares
    an algorithm's name, so a third algorithm changes no stage."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    names = set(algorithms.algorithm_names())
    own = {root / "heads" / "algorithms.py"} | {
        root / d / f"{n}.py" for d in ("heads", "train") for n in names
    }
    found = []
    for folder in (
        "eyas",
        "eyas/commands",
        "eyas/budget",
        "core",
        "target",
        "data",
        "heads",
        "train",
        "eval",
    ):
        for path in sorted((root / folder).glob("*.py")):
            if path in own:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in names
                    for part in (node.left, *node.comparators)
                    for c in ast.walk(part)
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
