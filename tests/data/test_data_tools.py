"""Tool conversations in: OpenAI and ShareGPT-style tool rows read into one shape, and
rendered with the real GPT-OSS, Qwen3-Coder and Llama 3.1 templates (their `tools`
argument) and with a template that has no tool support (the JSON text form): the
assistant's calls are trained, the results and the definitions never are."""

import json

import pytest
from support.real_formats import gpt_oss_tokenizer, llama3_tokenizer, qwen3_coder_tokenizer
from test_real_formats import _masked

from eyas.data.conversations import normalize_row, read_conversations
from eyas.data.templates import render_with_mask
from eyas.data.tool_text import tool_support
from eyas.data.tools import conversation_tools, openai_messages, same_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(cid, city, as_text=True):
    args = {"city": city}
    return {
        "id": cid,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(args) if as_text else args},
    }


OPENAI_ROW = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        # parallel calls, no content
        {"role": "assistant", "content": None, "tool_calls": [_call("a", "Paris"), _call("b", "Rome")]},
        {"role": "tool", "tool_call_id": "a", "content": "RESULT_PARIS 21C"},
        {"role": "tool", "tool_call_id": "b", "content": "RESULT_ROME 25C"},
        {"role": "assistant", "content": "Paris 21C, Rome 25C."},
        {"role": "user", "content": "And Oslo?"},
        # a call with content, arguments already a dict
        {"role": "assistant", "content": "Checking.", "tool_calls": [_call("c", "Oslo", as_text=False)]},
        {"role": "tool", "tool_call_id": "c", "content": "RESULT_OSLO 3C"},
        {"role": "assistant", "content": "Oslo 3C."},
    ],
}

SHAREGPT_ROW = {
    "tools": json.dumps([WEATHER["function"]]),
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {
            "from": "function_call",
            "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
        },
        {"from": "observation", "value": "RESULT_PARIS 21C"},
        {"from": "gpt", "value": "21C."},
    ],
}


def test_openai_tool_rows_keep_calls_results_and_definitions():
    conv, why = normalize_row(OPENAI_ROW)
    assert why is None and len(conv) == len(OPENAI_ROW["messages"])
    assert conversation_tools(conv) == [WEATHER]
    call_turn = conv[2]
    assert call_turn["content"] == "" and [c["function"]["arguments"] for c in call_turn["tool_calls"]] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    # results are linked to their calls by id and carry the function's name
    assert [(m["tool_call_id"], m["name"]) for m in conv if m["role"] == "tool"] == [
        ("a", "get_weather"),
        ("b", "get_weather"),
        ("c", "get_weather"),
    ]
    # what a server is sent: arguments as JSON text, tools beside the messages
    messages, tools = openai_messages(conv)
    assert tools == [WEATHER] and "tools" not in messages[0]
    assert json.loads(messages[2]["tool_calls"][1]["function"]["arguments"]) == {"city": "Rome"}


def test_sharegpt_function_call_and_observation_roles():
    conv, why = normalize_row(SHAREGPT_ROW)
    assert why is None
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
    assert conv[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert conv[2]["name"] == "get_weather" and conv[2]["tool_call_id"] == conv[1]["tool_calls"][0]["id"]
    assert conversation_tools(conv) == [WEATHER]


def test_bad_tool_rows_are_dropped_by_reason_never_as_unknown_role(tmp_path):
    rows = [
        OPENAI_ROW,
        SHAREGPT_ROW,
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "tool", "content": "orphan"},
                {"role": "assistant", "content": "y"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
                },
            ]
        },
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, report = read_conversations([str(path)])
    assert len(convs) == 2
    assert dict(report.dropped) == {"tool_result_without_call": 1, "bad_tool_json": 1}


def test_same_calls_compares_functions_and_arguments_not_ids():
    a = [_call("x", "Paris", as_text=False), _call("y", "Rome", as_text=False)]
    b = [_call("q", "Rome", as_text=False), _call("r", "Paris", as_text=False)]
    assert (
        same_calls(a, b) and not same_calls(a, b[:1]) and not same_calls(a[:1], [_call("z", "Oslo", False)])
    )


def _conv():
    conv, _ = normalize_row(OPENAI_ROW)
    return conv


CALL_GPT_OSS = ' to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "{}"}}<|call|>'


def _golden_check(r, tok, expected):
    assert _masked(tok, r) == expected
    # results and definitions are in the context, never trained
    trained = "".join(_masked(tok, r))
    for text in ("RESULT_PARIS", "RESULT_ROME", "RESULT_OSLO", "Weather of a city"):
        assert text in r.text and text not in trained


def test_gpt_oss_template_trains_commentary_calls_one_per_turn():
    tok = gpt_oss_tokenizer()
    assert tool_support(tok) == "single"  # the template renders tool_calls[0] only
    r = render_with_mask(tok, _conv(), "all")
    _golden_check(
        r,
        tok,
        [
            CALL_GPT_OSS.format("Paris"),
            CALL_GPT_OSS.format("Rome"),
            "<|channel|>final<|message|>Paris 21C, Rome 25C.<|end|>",
            CALL_GPT_OSS.format("Oslo"),
            "<|channel|>final<|message|>Oslo 3C.<|return|>",
        ],
    )
    # parallel calls become call/result pairs, so each result is named for its own call
    assert (
        r.text.index('"Rome"') > r.text.index("RESULT_PARIS")
        and "functions.get_weather to=assistant" in r.text
    )


def test_qwen3_coder_template_trains_xml_calls_parallel_in_one_turn():
    tok = qwen3_coder_tokenizer()
    assert tool_support(tok) == "native"
    r = render_with_mask(tok, _conv(), "all")
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>"
    _golden_check(
        r,
        tok,
        [
            xml.format("Paris") + "\n" + xml.format("Rome") + "<|im_end|>",
            "Paris 21C, Rome 25C.<|im_end|>",
            "Checking.\n\n" + xml.format("Oslo") + "<|im_end|>",
            "Oslo 3C.<|im_end|>",
        ],
    )
    assert "<tool_response>\nRESULT_PARIS 21C\n</tool_response>" in r.text


def test_llama31_template_trains_json_calls_one_per_turn():
    tok = llama3_tokenizer()
    assert tool_support(tok) == "single"  # it raises on two calls in one turn
    r = render_with_mask(tok, _conv(), "all")
    call = '{{"name": "get_weather", "parameters": {{"city": "{}"}}}}<|eot_id|>'
    _golden_check(
        r,
        tok,
        [
            call.format("Paris"),
            call.format("Rome"),
            "Paris 21C, Rome 25C.<|eot_id|>",
            call.format("Oslo"),
            "Oslo 3C.<|eot_id|>",
        ],
    )
    # the template writes a string result as JSON (a string is "iterable" to jinja)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"RESULT_OSLO 3C"<|eot_id|>' in r.text


def test_a_template_without_tool_support_gets_the_json_text_form(tiny_tokenizer):
    """The embedded target's ChatML template ignores tools: calls are trained as the JSON
    text, the results shown as user turns, and nothing is dropped."""
    assert tool_support(tiny_tokenizer) == "text"
    r = render_with_mask(tiny_tokenizer, _conv(), "all")
    call = '{{"name": "get_weather", "arguments": {{"city": "{}"}}}}'
    calls = f"<tool_call>[{call.format('Paris')}, {call.format('Rome')}]</tool_call>"
    _golden_check(
        r,
        tiny_tokenizer,
        [
            calls + "<|im_end|>",
            "Paris 21C, Rome 25C.<|im_end|>",
            f"Checking.\n<tool_call>[{call.format('Oslo')}]</tool_call><|im_end|>",
            "Oslo 3C.<|im_end|>",
        ],
    )
    assert (
        "<tools>\n[" in r.text
        and "<|im_start|>user\n<tool_response>\nRESULT_PARIS 21C\n</tool_response>\n<tool_response>" in r.text
    )


@pytest.mark.parametrize("make", [gpt_oss_tokenizer, qwen3_coder_tokenizer, llama3_tokenizer])
def test_last_turn_only_trains_the_final_answer(make):
    tok = make()
    r = render_with_mask(tok, _conv(), "last")
    assert len(_masked(tok, r)) == 1 and "Oslo 3C." in _masked(tok, r)[0]


def test_bfcl_splits_are_disjoint_and_serve_as_data_and_workload(tiny_tokenizer):
    """BFCL's questions: train and held-out splits by question id, every category read as
    tool conversations (no drop), multi-turn ones with the results BFCL's own backends
    return, and the held-out prompts carrying their tools into the rendered prompt."""
    from eyas.eval.workloads import load_workload, render_turn

    train, report = read_conversations(["bfcl:train"])
    assert report.kept == report.read == 900 and not report.dropped
    test = load_workload("bfcl:test", None)
    assert len(test) == 300 and all(p.tools for p in test)
    all_ids = [p.id for p in load_workload("bfcl", None)]
    assert len(all_ids) == len(set(all_ids)) == 1200 and {p.id for p in test} <= set(all_ids)
    categories = {p.category for p in test}
    assert categories == {"simple_python", "multiple", "parallel", "parallel_multiple", "multi_turn_base"}
    # parallel questions: several calls in one turn; multi-turn: results from the backends
    assert any(len(m.get("tool_calls", [])) > 1 for c in train for m in c)
    multi = next(c for c in train if sum(m["role"] == "user" for m in c) > 1)
    results = [m["content"] for m in multi if m["role"] == "tool"]
    assert results and all(r and "Error during execution" not in r for r in results[:1])
    # a held-out prompt renders with its tool definitions in the context
    p = test[0]
    text = tiny_tokenizer.decode(render_turn(tiny_tokenizer, p, []))
    assert p.tools[0]["function"]["name"] in text and "<tools>" in text


def test_bfcl_train_and_test_split_by_question_number():
    from eyas.data.bfcl import bfcl_rows

    train = {r["id"] for r in bfcl_rows("bfcl:train")}
    test = {r["id"] for r in bfcl_rows("bfcl:test")}
    assert not train & test and len(train) == 900 and len(test) == 300
    assert all(int(i.rsplit("_", 1)[1]) % 4 == 0 for i in test)


def test_dedupe_keeps_one_question_asked_with_other_tools():
    from eyas.data.samples import duplicate_indices

    conv = _conv()
    other = [
        {**conv[0], "tools": [{**WEATHER, "function": {**WEATHER["function"], "name": "forecast"}}]},
        *conv[1:],
    ]
    assert duplicate_indices([conv, other, _conv()], prompts_only=True) == [2]
