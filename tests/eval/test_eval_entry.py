"""`evaluate(recipe)`: the eval stage as a library call, and the command's flags over it."""

import json

import pytest
from support.train_run_fixtures import tiny_recipe

from eyas.cli import main
from eyas.eval.evaluate import EvalError, evaluate


def _recipe(tmp_path, tiny_llama_dir, **eval_keys):
    recipe = tiny_recipe(tmp_path / "run", tiny_llama_dir)
    section = {"max_prompts": 2, "max_new_tokens": 6, "dtype": "float32", **eval_keys}
    return recipe.model_copy(update={"eval": recipe.eval.model_copy(update=section)})


def test_evaluate_writes_the_report_of_the_recipes_eval_section(tmp_path, tiny_llama_dir):
    report, paths = evaluate(_recipe(tmp_path, tiny_llama_dir, k=3), progress=False)
    assert report["k"] == 3 and report["num_prompts"] == 2 and set(report["drafters"]) == {"ngram"}
    assert report["lossless"]["passed"]
    assert (
        json.loads(open(paths["json"]).read())["drafters"]["ngram"]["tau"]
        == report["drafters"]["ngram"]["tau"]
    )
    assert paths["json"].startswith(str(tmp_path / "run" / "eval"))


def test_evaluate_refuses_nothing_to_evaluate_and_compare_without_a_head(tmp_path, tiny_llama_dir):
    with pytest.raises(EvalError, match="nothing to evaluate"):
        evaluate(_recipe(tmp_path, tiny_llama_dir, baseline=None), progress=False)
    with pytest.raises(EvalError, match="--compare needs a head"):
        evaluate(_recipe(tmp_path, tiny_llama_dir), compare={"other": "x"}, progress=False)


def test_eval_flags_are_checked_as_recipe_values(tmp_path, capsys):
    assert main(["eval", "--baseline", "ngram", "--k", "0", f"run_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.strip().startswith("eyas eval: --k:") and "Traceback" not in err
