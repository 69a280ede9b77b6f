"""`data.train_on: turns`: one sample per assistant turn, its context what the template
renders when serving that turn (history rewritten: GPT-OSS drops earlier analysis, Qwen3
earlier <think>), so every trained token sits in a context the target produced it in;
prepare splits by conversation, never a turn of one conversation in each split."""

import json

import pytest
from support.real_formats import gpt_oss_tokenizer, qwen3_tokenizer
from test_real_formats import CONV as TWO_TURNS

from eyas.cli import main
from eyas.data.conversations import DropReport
from eyas.data.prepare import load_prepared, load_token_frequencies, render_all

CONV = [
    *TWO_TURNS,
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6.", "reasoning": "add again", "reasoning_effort": "high"},
]


def _serving_prompt(tok, history, **kwargs):
    """What the target is given when serving the turn after `history`."""
    text = tok.apply_chat_template(
        [{k: v for k, v in m.items() if k in ("role", "content")} for m in history],
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("make", [gpt_oss_tokenizer, qwen3_tokenizer])
def test_each_turn_is_a_sample_in_the_context_the_target_served_it(make):
    tok = make()
    conv = [{k: v for k, v in m.items() if k != "reasoning_effort"} for m in CONV]
    report = DropReport(read=1, kept=1)
    ids, masks, kept = render_all(tok, [conv], 4096, "turns", report, progress=False)
    assert kept == [0, 0, 0] and report.kept == 1
    turns = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
    for k, sample, mask in zip(turns, ids, masks):
        first = mask.index(1)
        # the context is the serving prompt of turn k, token for token
        assert sample[:first] == _serving_prompt(tok, conv[:k])
        # only turn k is trained, its reasoning included, up to its end-of-turn token
        trained = tok.decode([t for t, m in zip(sample, mask) if m], skip_special_tokens=False)
        assert conv[k]["reasoning"] in trained and trained.rstrip().endswith(("<|return|>", "<|im_end|>")), (
            trained
        )
        assert all(mask[first : first + sum(mask)])  # one span: turn k's
    # with `all`, the earlier turns' reasoning is never trained (the template dropped it)
    (whole,), (whole_mask,), _ = render_all(tok, [conv], 4096, "all", DropReport(), progress=False)
    trained_all = tok.decode([t for t, m in zip(whole, whole_mask) if m], skip_special_tokens=False)
    assert "greet back" not in trained_all and "add them" not in trained_all


def test_a_turn_regenerated_at_an_effort_is_served_at_it():
    tok = gpt_oss_tokenizer()
    conv = [dict(m, reasoning_effort="high") if m["role"] == "assistant" else m for m in CONV]
    ids, masks, _ = render_all(tok, [conv], 4096, "turns", DropReport(read=1, kept=1), progress=False)
    for k, sample, mask in zip((2, 4, 6), ids, masks):
        assert sample[: mask.index(1)] == _serving_prompt(tok, conv[:k], reasoning_effort="high")


def test_turns_that_do_not_fit_are_dropped_and_the_rest_kept():
    tok = qwen3_tokenizer()
    long = [*CONV[:5], {"role": "user", "content": "word " * 300}, CONV[6]]
    report = DropReport(read=1, kept=1)
    ids, _, kept = render_all(tok, [long], 200, "turns", report, progress=False)
    assert kept == [0, 0] and report.kept == 1 and not report.dropped
    assert report.repaired == {"turns_dropped_over_length": 1}


def _corpus(path, n=20):
    rows = []
    for k in range(n):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "hello"},  # every conversation opens alike
                    {"role": "assistant", "content": "hi!"},
                    {"role": "user", "content": f"question {k}?"},
                    {"role": "assistant", "content": f"answer {k}."},
                    {"role": "user", "content": "thanks"},
                    {"role": "assistant", "content": f"welcome {k}"},
                ]
            }
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prepare_splits_turn_samples_by_conversation(tiny_llama_dir, tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl")
    args = [f"target.name_or_path={tiny_llama_dir}", f"data.sources=[{corpus}]", "data.eval_fraction=0.25"]
    assert (
        main(["prepare", "--no-progress", f"run_dir={tmp_path / 'turns'}", *args, "data.train_on=turns"]) == 0
    )
    assert main(["prepare", "--no-progress", f"run_dir={tmp_path / 'all'}", *args, "data.train_on=all"]) == 0
    turns, whole = (
        load_prepared(tmp_path / "turns" / "prepared"),
        load_prepared(tmp_path / "all" / "prepared"),
    )
    train_c, eval_c = set(turns["train"]["conversation"]), set(turns["eval"]["conversation"])
    # never a turn of one conversation in train and another in eval; the same split as `all`
    assert not train_c & eval_c and len(eval_c) == 5
    assert (train_c, eval_c) == (set(whole["train"]["conversation"]), set(whole["eval"]["conversation"]))
    # three turns per conversation, less the repeated opening ("hello" -> "hi!"): kept once
    report = json.loads((tmp_path / "turns" / "prepared" / "drop_report.json").read_text())
    assert report["repaired"]["turns_dropped_duplicate"] == 19
    assert len(turns["train"]) + len(turns["eval"]) == 20 * 3 - 19
    # each reply is trained once: the masked tokens are the same as one sample per conversation
    # has, less the repeated opening's
    freqs, freqs_all = (load_token_frequencies(tmp_path / d / "prepared") for d in ("turns", "all"))
    assert (freqs <= freqs_all).all() and freqs.sum() > 0
    prompts = (tmp_path / "turns" / "prepared" / "eval_prompts.jsonl").read_text().splitlines()
    assert len(prompts) == len(eval_c)  # one eval prompt per held-out conversation


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3-coder"])
def test_tool_conversations_make_a_sample_per_turn_calls_trained_results_not(family):
    from support.real_formats import qwen3_coder_tokenizer
    from test_data_tools import OPENAI_ROW

    from eyas.data.conversations import normalize_row
    from eyas.data.templates import prompt_ids
    from eyas.data.tool_text import as_served

    tok = gpt_oss_tokenizer() if family == "gpt-oss" else qwen3_coder_tokenizer()
    conv, why = normalize_row(OPENAI_ROW)
    assert why is None
    ids, masks, kept = render_all(tok, [conv], 8192, "turns", DropReport(read=1, kept=1), progress=False)
    # the turns the target serves: GPT-OSS makes one call per turn, so the parallel calls
    # are two turns there (call, result, call, result), one for Qwen3-Coder
    served = as_served(tok, conv)
    turns = [k for k, m in enumerate(served) if m["role"] == "assistant"]
    assert len(turns) == (5 if family == "gpt-oss" else 4) and kept == [0] * len(turns)
    for k, sample, mask in zip(turns, ids, masks):
        # the context is the prompt regeneration sends for turn k (tools and results included)
        assert sample[: mask.index(1)] == prompt_ids(tok, served[:k])
        trained = tok.decode([t for t, m in zip(sample, mask) if m], skip_special_tokens=False)
        assert "RESULT_" not in trained and "Weather of a city" not in trained
        if served[k].get("tool_calls"):
            assert ("to=functions.get_weather" if family == "gpt-oss" else "<tool_call>") in trained
            assert all(c["function"]["arguments"]["city"] in trained for c in served[k]["tool_calls"])
