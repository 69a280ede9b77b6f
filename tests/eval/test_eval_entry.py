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


def _count_plain_decodes(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Counts the plain decodes `run_eval` makes (the warm-up is the first); the one
    numbered `fail_at` raises, as a kill would stop the run there."""
    import eyas.eval.evaluate as ev

    real, calls = ev.greedy_decode, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "greedy_decode", counted)
    return calls


def _same_results(a: dict, b: dict) -> None:
    for key in ("tau", "per_position_acceptance", "verify_steps", "proposed", "accepted", "generated_tokens"):
        assert a["drafters"]["ngram"][key] == b["drafters"]["ngram"][key]
    assert a["plain"]["generated_tokens"] == b["plain"]["generated_tokens"]
    assert a["per_turn"].keys() == b["per_turn"].keys()
    assert a["lossless"]["checked"] == b["lossless"]["checked"]
    assert a["num_sequences"] == b["num_sequences"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # sampled: each sequence keeps its own seed
def test_a_killed_eval_resumes_and_decodes_only_the_prompts_it_had_not_finished(
    tmp_path, tiny_llama_dir, monkeypatch, temperature
):
    recipe = _recipe(
        tmp_path,
        tiny_llama_dir,
        k=3,
        max_prompts=3,
        max_new_tokens=24,
        decode_baseline=True,
        temperature=temperature,
    )
    fresh, _ = evaluate(recipe, out=tmp_path / "fresh", progress=False)
    # killed at the first turn of the second prompt: warm-up, prompt 1's two turns, then this
    calls = _count_plain_decodes(monkeypatch, fail_at=4)
    with pytest.raises(KeyboardInterrupt):
        evaluate(recipe, out=tmp_path / "killed", progress=False)
    log = tmp_path / "killed" / "eval_sequences.jsonl"
    assert [json.loads(line)["index"] for line in log.read_text().splitlines()] == [0]
    calls[0] = 0
    monkeypatch.undo()
    calls = _count_plain_decodes(monkeypatch)
    resumed, paths = evaluate(recipe, out=tmp_path / "killed", progress=False)
    assert calls[0] == 1 + 2 + 2  # the warm-up and prompts 2 and 3, both turns each
    _same_results(resumed, fresh)
    assert resumed["drafters"]["ngram"]["generated_tokens"] > 3 * 2
    if temperature == 0:  # greedy: the tiny model repeats itself, so n-gram drafts are accepted
        assert resumed["drafters"]["ngram"]["accepted"] > 0
    assert paths["sequences"] == str(log)
    assert len(log.read_text().splitlines()) == 3


def test_records_of_other_settings_or_a_line_cut_by_a_kill_are_decoded_again(
    tmp_path, tiny_llama_dir, monkeypatch, caplog
):
    recipe = _recipe(tmp_path, tiny_llama_dir, k=3, max_prompts=2, decode_baseline=True)
    evaluate(recipe, out=tmp_path / "e", progress=False)
    log = tmp_path / "e" / "eval_sequences.jsonl"
    lines = log.read_text().splitlines()
    # the second record cut off mid-line by a kill: only the first prompt is kept
    log.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    calls = _count_plain_decodes(monkeypatch)
    again, _ = evaluate(recipe, out=tmp_path / "e", progress=False)
    assert calls[0] == 1 + 2
    assert len(log.read_text().splitlines()) == 2
    # another k: every record was made with other settings, so every prompt is decoded again
    calls[0] = 0
    other = recipe.model_copy(update={"eval": recipe.eval.model_copy(update={"k": 2})})
    with caplog.at_level("WARNING"):
        report, _ = evaluate(other, out=tmp_path / "e", progress=False)
    assert calls[0] == 1 + 4 and report["k"] == 2
    assert "dropping 2 records" in caplog.text and "eval_sequences.jsonl" in caplog.text
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1]  # the k = 3 records are gone from the log


def test_a_larger_subset_of_the_workload_reuses_the_greedy_prompts_it_shares(
    tmp_path, tiny_llama_dir, monkeypatch
):
    recipe = _recipe(tmp_path, tiny_llama_dir, k=3, max_prompts=2, decode_baseline=True)
    evaluate(recipe, out=tmp_path / "e", progress=False)  # MT-bench questions 0 and 40
    more = recipe.model_copy(update={"eval": recipe.eval.model_copy(update={"max_prompts": 4})})
    calls = _count_plain_decodes(monkeypatch)
    report, _ = evaluate(more, out=tmp_path / "e", progress=False)  # 0, 20, 40 and 60
    assert calls[0] == 1 + 2 * 2 and report["num_prompts"] == 4
    fresh, _ = evaluate(more, out=tmp_path / "fresh", progress=False)
    _same_results(report, fresh)
