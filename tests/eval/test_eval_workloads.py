"""Prompt-lookup drafting, workloads, the report and the `eyas eval` command."""

import json

import numpy as np
import pytest

from eyas.cli import main
from eyas.data.sources import mtbench_path
from eyas.eval.ngram import ngram_propose
from eyas.eval.report import verdicts
from eyas.eval.speculate import DecodeTrace
from eyas.eval.trace_summary import summarize
from eyas.eval.workloads import load_workload, render_turn, subsample


def test_ngram_prefers_the_longest_match_and_its_earliest_occurrence():
    toks = np.array([7, 1, 2, 3, 9, 5, 2, 3, 8, 8, 1, 2, 3])
    # suffix (1,2,3) first occurs at 1 -> propose what followed: 9 5 2
    assert ngram_propose(toks, 3, 1, 4).tolist() == [9, 5, 2]
    # only 1..2-grams allowed: (2,3) earliest at 2 -> 9 5 2 3 (k=4)
    assert ngram_propose(toks, 4, 1, 2).tolist() == [9, 5, 2, 3]
    # vLLM default 5..5: no 5-gram recurs -> nothing
    assert ngram_propose(toks, 3).tolist() == []
    # proposals stop at the end of the context
    assert ngram_propose(np.array([4, 6, 4]), 5, 1, 2).tolist() == [6, 4]
    with pytest.raises(ValueError):
        ngram_propose(toks, 3, 3, 2)


def test_mtbench_has_80_two_turn_questions_in_8_categories():
    assert mtbench_path().is_file()
    prompts = load_workload("mtbench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert len({p.category for p in prompts}) == 8
    sub = load_workload("mtbench", max_prompts=8)
    assert len({p.category for p in sub}) == 8  # evenly spaced over the category blocks
    assert [p.id for p in sub] == [p.id for p in load_workload("mtbench", max_prompts=8)]


def test_jsonl_workload_shapes_and_errors(tmp_path, tiny_tokenizer):
    path = tmp_path / "w.jsonl"
    rows = [
        {"prompt": "hi", "category": "a"},
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "u2"},
            ]
        },
        {"turns": ["t1", "t2"]},
        {"nothing": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = load_workload(str(path))
    assert [p.turns for p in prompts] == [["hi"], ["u1", "u2"], ["t1", "t2"]]
    assert prompts[1].system == "s" and prompts[0].category == "a"
    ids = render_turn(tiny_tokenizer, prompts[1], ["my reply"])
    text = tiny_tokenizer.decode(ids)
    assert text.index("u1") < text.index("my reply") < text.index("u2") and text.endswith(
        "<|im_start|>assistant\n"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_workload(str(bad))
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="no row with a prompt"):
        load_workload(str(empty))
    assert subsample(list(range(10)), 3) == [0, 3, 6]


@pytest.mark.parametrize("case", ["empty", "misspelt", "relative", "bad_array", "no_head"])
def test_eval_names_a_bad_workload_or_head_before_loading_the_target(case, tmp_path, monkeypatch, capsys):
    import eyas.target.load as targets

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the workload was read")

    monkeypatch.setattr(targets, "load_target", no_target)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "array.json").write_text('[{"prompt": "a"}, {oops')
    args, named = {
        "empty": (["--workload", "empty.jsonl"], "'empty.jsonl': no row with a prompt"),
        "misspelt": (
            ["--workload", "mtbnech"],
            "'mtbnech': no such file or directory (the shipped workload is 'mtbench'",
        ),
        "relative": (["--workload", "data/held_out.jsonl"], "'data/held_out.jsonl': no such file"),
        "bad_array": (["--workload", "array.json"], "array.json: not a valid JSON array"),
        "no_head": (["--head", "runs/x/export"], "runs/x/export: no such head directory"),
    }[case]
    assert main(["eval", "--baseline", "ngram", *args]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1].startswith("eyas eval: ") and named in captured.err


def test_summary_counts_conditional_acceptance():
    # K=3: step 1 accepts 2 of 3, step 2 accepts 0 of 3, step 3 proposes 1 and accepts it
    tr = DecodeTrace(tokens=[1] * 7, seconds=1.0, forwards=4, drafted=[3, 3, 1], accepted=[2, 0, 1])
    s = summarize([tr], 3)
    assert s["per_position_acceptance"] == [2 / 3, 1.0, 0.0]
    assert s["reached_per_position"] == [3, 1, 1]
    assert s["tar"] == pytest.approx(3 / 7)
    assert s["tau"] == pytest.approx(6 / 3)


def test_eval_cli_baseline_and_head(tmp_path, tiny_llama_dir, capsys):
    import torch
    from test_eval_speculate import random_head

    from eyas.heads.io import save_head
    from eyas.target.load import load_target

    wl = tmp_path / "w.jsonl"
    wl.write_text(
        "\n".join(json.dumps({"turns": [f"say {c} {c} {c} {c} again", "more"], "category": c}) for c in "ab")
    )
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    head = random_head(target.model, "eagle3")
    save_head(head, tmp_path / "head")
    common = [
        "--target",
        str(tiny_llama_dir),
        "--workload",
        str(wl),
        "--k",
        "3",
        "--max-new-tokens",
        "24",
        "--no-progress",
        "target.dtype=float32",
        "target.device=cpu",
        "eval.ngram_min=1",
        "eval.ngram_max=3",
    ]
    rc = main(["eval", *common, "--head", str(tmp_path / "head"), "--out", str(tmp_path / "ev"), "--json"])
    report = json.loads(capsys.readouterr().out)
    # beside a head the n-gram baseline is replayed over the plain tokens: only the head is checked
    assert rc == 0 and report["lossless"]["passed"] and report["lossless"]["checked"] == 4
    assert report["replayed"] == ["ngram"] and report["drafters"]["ngram"]["tokens_per_s"] is None
    assert set(report["drafters"]) == {"head", "ngram"} and set(report["per_category"]) == {"a", "b"}
    # two turns per prompt: each turn's summary counts one sequence per prompt
    assert set(report["per_turn"]) == {"1", "2"}
    assert all(report["per_turn"][t]["head"]["sequences"] == 2 for t in ("1", "2"))
    assert report["num_sequences"] == 4 and report["plain"]["tokens_per_s"] > 0
    a1 = report["drafters"]["head"]["per_position_acceptance"][0]
    assert a1 < 0.3 and any("first draft token" in w and "below 30%" in w for w in report["warnings"])
    for name in ("eval_report.json", "eval_report.md", "eval_report.png"):
        assert (tmp_path / "ev" / name).stat().st_size > 100
    # --decode-baseline decodes it: the same acceptance, its tok/s measured, both checked
    rc = main(
        [
            "eval",
            *common,
            "--head",
            str(tmp_path / "head"),
            "--out",
            str(tmp_path / "ev1"),
            "--json",
            "--decode-baseline",
        ]
    )
    decoded = json.loads(capsys.readouterr().out)
    assert rc == 0 and decoded["lossless"]["checked"] == 8 and decoded["replayed"] == []
    replayed_ngram, decoded_ngram = report["drafters"]["ngram"], decoded["drafters"]["ngram"]
    assert decoded_ngram["tokens_per_s"] > 0
    for key in ("tau", "verify_steps", "accepted", "proposed", "per_position_acceptance"):
        assert replayed_ngram[key] == decoded_ngram[key], key
    # --decoded-prompts 1: the head decoded on the first prompt, replayed on the second; the
    # same acceptance, tok/s and the lossless check from the decoded prompt
    rc = main(["eval", *common, "--head", str(tmp_path / "head"), "--out", str(tmp_path / "ev3"), "--json",
               "--decoded-prompts", "1"])  # fmt: skip
    partly = json.loads(capsys.readouterr().out)
    assert rc == 0 and partly["decoded_prompts"] == 1 and partly["lossless"]["checked"] == 2
    for key in ("tau", "verify_steps", "accepted", "proposed", "per_position_acceptance"):
        assert partly["drafters"]["head"][key] == report["drafters"]["head"][key], key
    assert partly["drafters"]["head"]["tokens_per_s"] > 0 and partly["plain"]["tokens_per_s"] > 0
    rc = main(["eval", *common, "--head", str(tmp_path / "head"), "--out", str(tmp_path / "ev3"),
               "--decoded-prompts", "1"])  # fmt: skip
    assert rc == 0 and "decoded against the target on 1 of the 2 prompts" in capsys.readouterr().out
    rc = main(["eval", *common, "--baseline", "ngram", "--out", str(tmp_path / "ev2")])
    out = capsys.readouterr().out
    assert rc == 0 and "plain greedy" in out and "ngram" in out and "lossless check: PASSED" in out
    # --dtype (eval.dtype) evaluates the target in another dtype than the recipe's target.dtype
    rc = main(
        [
            "eval",
            *common,
            "--baseline",
            "ngram",
            "--out",
            str(tmp_path / "ev3"),
            "--json",
            "--dtype",
            "bfloat16",
        ]
    )
    assert rc == 0 and json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    torch.manual_seed(0)


def test_low_accuracy_warning_reads_first_position_not_tar():
    # K = 5, tau 2.4: deep positions decay, so TAR is 28% although the target accepts the
    # first draft token 57% of the time; that head is worth serving and gets no warning.
    good = {"tau": 2.40, "tar": 0.28, "per_position_acceptance": [0.57, 0.64, 0.65, 0.61, 0.57]}
    poor = {"tau": 1.20, "tar": 0.05, "per_position_acceptance": [0.12, 0.3, 0.2, 0.1, 0.0]}
    ngram = {"tau": 1.80}
    assert not any("first draft token" in w for w in verdicts({"drafters": {"head": good, "ngram": ngram}}))
    warned = verdicts({"drafters": {"head": poor, "ngram": ngram}})
    assert any("12.0%" in w and "below 30%" in w for w in warned)
    assert any("does not beat prompt lookup" in w for w in warned)


def test_a_head_slower_than_plain_offline_is_told_where_its_served_speed_comes_from():
    # the quickstart's numbers: tau 1.54, 13.4 tokens/s against plain 15.9 on a CPU
    report = {
        "device": "cpu",
        "plain": {"tokens_per_s": 15.9},
        "drafters": {"head": {"tau": 1.54, "tokens_per_s": 13.4}, "ngram": {"tau": 1.38}},
    }
    (note,) = [w for w in verdicts(report) if w.startswith("note:")]
    assert "head decoded slower than plain" in note and "on cpu" in note and "eyas bench-serve" in note
    report["drafters"]["head"]["tokens_per_s"] = 21.0
    assert not [w for w in verdicts(report) if w.startswith("note:")]
    # a head that accepts nothing is slower for its own reason: the other warnings say it
    report["drafters"]["head"] = {"tau": 1.0, "tokens_per_s": 10.0}
    assert not [w for w in verdicts(report) if w.startswith("note:")]


def test_humaneval_splits_are_disjoint_and_serve_as_data_and_workload():
    from eyas.data.conversations import read_conversations
    from eyas.eval.workloads import load_workload

    test = load_workload("humaneval:test", None)
    train, report = read_conversations(["humaneval:train"])
    assert (len(test), len(train), report.kept) == (41, 123, 123)
    test_prompts = {p.turns[0] for p in test}
    train_prompts = {c[0]["content"] for c in train}
    assert not test_prompts & train_prompts
    assert len(test_prompts | train_prompts) == len(load_workload("humaneval", None)) == 164
    assert all("```python" in p for p in test_prompts)
