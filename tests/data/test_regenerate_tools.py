"""Regenerating tool conversations: the server backend sends `tools` and the history; a
reply's calls come from the server's tool parser or from its raw text (the parser the hf
backend uses); recorded results are replayed after the same calls, and a conversation
ends (`tool_divergence`) where the target calls something the record has no results for.
End to end on the real GPT-OSS, Qwen3-Coder and Llama 3.1 templates and the embedded
target's ChatML template: read -> regenerate -> store -> render -> masks."""

import json
from collections import Counter

import pytest
from support.fake_openai_server import FakeChatServer
from support.real_formats import gpt_oss_tokenizer, llama3_tokenizer, qwen3_coder_tokenizer
from test_data_tools import OPENAI_ROW
from test_real_formats import _masked

from eyas.data.conversations import normalize_row
from eyas.data.reasoning import decoded_reply
from eyas.data.regenerate import done_records, regenerate
from eyas.data.regenerate_settings import RegenerationSettings, ServerSettings
from eyas.data.templates import render_with_mask
from eyas.data.tool_text import tool_support

CITIES = ["Paris", "Rome"]


def _raw_call(family: str, cities: list[str]) -> str:
    if family == "harmony":
        (city,) = cities
        return f' to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "{city}"}}<|call|>'
    if family == "xml":
        return "\n".join(
            f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{c}\n</parameter>\n</function>\n</tool_call>"
            for c in cities
        )
    if family == "json":
        (city,) = cities
        return json.dumps({"name": "get_weather", "parameters": {"city": city}})
    return (
        "<tool_call>"
        + json.dumps([{"name": "get_weather", "arguments": {"city": c}} for c in cities])
        + "</tool_call>"
    )


def _raw_text(family: str, text: str) -> str:
    return f"<|channel|>final<|message|>{text}<|return|>" if family == "harmony" else text


def _script(family: str, one_call_per_turn: bool):
    """A target that calls get_weather for the cities it is asked about (one per turn
    where its template allows no more), answers once it has the results, and asks for
    Bergen instead of Oslo (a call the record has no result for)."""

    def reply(messages):
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        results = [m for m in messages[last_user:] if m["role"] == "tool"]
        if "Oslo" in messages[last_user]["content"]:
            return _raw_call(family, ["Bergen"])
        if len(results) < len(CITIES):
            return _raw_call(family, CITIES[len(results) : len(results) + 1] if one_call_per_turn else CITIES)
        return _raw_text(family, "Paris 21C, Rome 25C.")

    return reply


FAMILIES = [
    (gpt_oss_tokenizer, "harmony"),
    (qwen3_coder_tokenizer, "xml"),
    (llama3_tokenizer, "json"),
    (None, "text"),
]


@pytest.mark.parametrize("tool_parser", [True, False], ids=["server-parses", "raw-text"])
@pytest.mark.parametrize("make,family", FAMILIES, ids=[f for _, f in FAMILIES])
def test_tool_conversation_survives_regeneration_storage_and_rendering(
    make, family, tool_parser, tiny_tokenizer, tmp_path
):
    tok = make() if make else tiny_tokenizer
    single = tool_support(tok) == "single"
    conv, _ = normalize_row(OPENAI_ROW)
    checks = Counter()
    out = tmp_path / "regenerated.jsonl"
    with FakeChatServer(
        tok, script=_script(family, single), tool_parser=tool_parser, reasoning="raw"
    ) as server:
        settings = ServerSettings(urls=[server.url], concurrency=1, backoff_s=0.01)
        (got,) = regenerate(
            [conv],
            tok,
            out,
            RegenerationSettings(backend="server", max_new_tokens=64, server=settings, progress=False),
            token_checks=checks,
        )
    # every request carried the tools; the first asked from the history before the first reply
    assert all(r["tools"] == OPENAI_ROW["tools"] for r in server.requests)
    roles = [m["role"] for m in got]
    calls = [[c["function"]["arguments"]["city"] for c in m.get("tool_calls", [])] for m in got]
    per_turn = [["Paris"], ["Rome"]] if single else [["Paris", "Rome"]]
    # the recorded results replayed after the target's matching calls; Bergen ends it
    assert [c for c in calls if c] == [*per_turn, ["Bergen"]]
    assert roles.count("tool") == 2 and got[-1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Bergen"
    }
    assert checks["tool_divergence"] == 1
    assert [m["content"] for m in got if m["role"] == "tool"] == ["RESULT_PARIS 21C", "RESULT_ROME 25C"]
    # stored as it came back, and rendered with the calls trained, results and tools not
    assert done_records(out)[0]["messages"] == got
    r = render_with_mask(tok, got, "all")
    trained = "".join(_masked(tok, r))
    for city in ("Paris", "Rome", "Bergen"):
        assert city in trained
    assert "Paris 21C, Rome 25C." in trained
    for context in ("RESULT_PARIS", "RESULT_ROME", "Weather of a city"):
        assert context in r.text and context not in trained


def test_a_text_reply_where_the_record_calls_tools_ends_the_conversation(tiny_tokenizer, tmp_path):
    conv, _ = normalize_row(OPENAI_ROW)
    with FakeChatServer(tiny_tokenizer, script=lambda m: "I cannot check the weather.") as server:
        settings = ServerSettings(urls=[server.url], concurrency=1, backoff_s=0.01)
        checks = Counter()
        (got,) = regenerate(
            [conv],
            tiny_tokenizer,
            tmp_path / "r.jsonl",
            RegenerationSettings(backend="server", max_new_tokens=64, server=settings, progress=False),
            token_checks=checks,
        )
    assert [m["role"] for m in got] == ["system", "user", "assistant"] and checks["tool_divergence"] == 1
    assert got[-1]["content"] == "I cannot check the weather." and len(server.requests) == 1


def test_the_hf_backend_reads_calls_from_the_decoded_text(tiny_tokenizer):
    raw = 'Checking.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    ids = tiny_tokenizer(raw, add_special_tokens=False)["input_ids"]
    reply = decoded_reply(tiny_tokenizer, ids, parse_calls="tagged")
    assert reply["content"] == "Checking."
    assert reply["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    # without tools offered, the same text is plain content; cut by length, it is no call
    assert decoded_reply(tiny_tokenizer, ids)["content"] == raw
    assert "tool_calls" not in decoded_reply(tiny_tokenizer, ids, finished=False, parse_calls="tagged")


def test_the_hf_backend_replays_results_and_stops_at_divergence(tiny_tokenizer, tmp_path, monkeypatch):
    """The in-process backend walks a tool conversation the same way: the scripted target
    (standing in for the decoder) calls, gets the recorded results, answers, then diverges."""
    import eyas.data.regenerate as regen
    from eyas.data.decode import DecodedReply

    script = _script("text", one_call_per_turn=False)
    prompts_seen = []

    def fake_decode(model, tokenizer, prompts, *args, **kwargs):
        out = []
        for ids in prompts:
            text = tokenizer.decode(ids)
            prompts_seen.append(text)
            # the script reads the conversation back from the rendered prompt's last user turn
            last_user = text.rsplit("<|im_start|>user\n", 1)[1]
            results = last_user.count("<tool_response>")
            messages = [{"role": "user", "content": last_user}] + [{"role": "tool", "content": ""}] * results
            raw = script(messages)
            out.append(
                DecodedReply(token_ids=tokenizer(raw, add_special_tokens=False)["input_ids"], text=raw)
            )
        return out

    monkeypatch.setattr(regen, "decode_replies_hf", fake_decode)
    conv, _ = normalize_row(OPENAI_ROW)
    out = tmp_path / "hf.jsonl"
    (got,) = regenerate(
        [conv], tiny_tokenizer, out, RegenerationSettings(max_new_tokens=64, progress=False), model=object()
    )
    calls = [[c["function"]["arguments"]["city"] for c in m.get("tool_calls", [])] for m in got]
    assert [c for c in calls if c] == [["Paris", "Rome"], ["Bergen"]]
    assert [m["content"] for m in got if m["role"] == "tool"] == ["RESULT_PARIS 21C", "RESULT_ROME 25C"]
    assert done_records(out)[0]["token_checks"] == {"tool_divergence": 1}
    assert len(prompts_seen) == 3 and "<tools>" in prompts_seen[0]


def test_a_server_without_a_tool_parser_gets_tool_choice_none_and_raw_text(tiny_tokenizer, tmp_path):
    """vLLM started without --enable-auto-tool-choice refuses tools under the default
    `auto`; regeneration goes on with `tool_choice: none` (tools still in the prompt) and
    reads the calls from the raw text."""
    conv, _ = normalize_row(OPENAI_ROW)
    with FakeChatServer(
        tiny_tokenizer,
        script=_script("text", one_call_per_turn=False),
        no_auto_tools=True,
        token_ids_unsupported=True,
    ) as server:
        settings = ServerSettings(urls=[server.url], concurrency=1, backoff_s=0.01)
        (got,) = regenerate(
            [conv],
            tiny_tokenizer,
            tmp_path / "r.jsonl",
            RegenerationSettings(backend="server", max_new_tokens=64, server=settings, progress=False),
        )
    assert [c["function"]["arguments"]["city"] for c in got[2]["tool_calls"]] == ["Paris", "Rome"]
    assert (
        all(r["tool_choice"] == "none" for r in server.requests[2:])
        and "tool_choice" not in server.requests[0]
    )
