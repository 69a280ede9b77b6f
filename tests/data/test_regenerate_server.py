"""Regeneration through an OpenAI-compatible server (data.regenerate.backend=server),
against the fake server of tests/support/fake_openai_server.py on 127.0.0.1; the harmony parser
shared with the in-process decoder."""

import json
import sys
from pathlib import Path

import pytest
from support.data_templates_fixtures import family_tokenizer
from support.fake_openai_server import FakeChatServer
from support.ports import free_port

from eyas.cli import main
from eyas.data.reasoning import assistant_message, decoded_reply, parse_harmony, split_think
from eyas.data.regenerate import regenerate
from eyas.data.regenerate_server import ServerError
from eyas.data.regenerate_settings import RegenerationSettings, ServerSettings
from eyas.data.templates import render_with_mask
from eyas.recipe import RecipeError, recipe_from_dict

HARMONY_REPLY = (
    "<|channel|>analysis<|message|>The user wants a sum; 2+2 is 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)


def _convs(n=6):
    return [
        [
            {"role": "user", "content": f"question {k}?"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "old2"},
        ]
        for k in range(n)
    ]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from eyas.target.load import load_target

    return load_target(str(tiny_llama_dir), dtype="float32", device="cpu")


def _settings(*urls, **kw):
    return ServerSettings(urls=list(urls), concurrency=4, backoff_s=0.01, **kw)


def test_server_replies_equal_the_in_process_decoder_and_resume(tiny, tmp_path):
    convs = _convs()
    hf = regenerate(
        convs,
        tiny.tokenizer,
        tmp_path / "hf.jsonl",
        RegenerationSettings(batch_size=1, max_new_tokens=6, progress=False),
        model=tiny.model,
    )
    out = tmp_path / "server.jsonl"
    with FakeChatServer(tiny.tokenizer, tiny.model) as server:
        checks = __import__("collections").Counter()
        got = regenerate(
            convs,
            tiny.tokenizer,
            out,
            RegenerationSettings(
                backend="server", max_new_tokens=6, server=_settings(server.url), progress=False
            ),
            token_checks=checks,
        )
        assert got == hf
        # the random tiny target never stops within 6 tokens: each first reply is cut at
        # max_new_tokens, marked so, and ends its conversation (no turn answers unfinished text)
        assert all(len(c) == 2 and c[1]["finish_reason"] == "length" for c in got)
        assert len(server.requests) == 6
        assert all(r["model"] == "tiny-target" and r["return_token_ids"] for r in server.requests)
        assert checks["turns_compared"] == 6 and checks["prompt_tokens_differ"] == 0
        # a kill: three whole records and half a line kept; the rerun asks only for the rest
        lines = out.read_text().splitlines()
        out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:7])
        server.requests.clear()
        assert (
            regenerate(
                convs,
                tiny.tokenizer,
                out,
                RegenerationSettings(
                    backend="server", max_new_tokens=6, server=_settings(server.url), progress=False
                ),
            )
            == hf
        )
        assert len(server.requests) == 3
        done = {r["messages"][0]["content"] for r in server.requests}
        assert done == {c[0]["content"] for c in (convs[json.loads(row)["index"]] for row in lines[3:])}


def test_finished_turns_carry_the_targets_reply_into_the_next_prompt(tiny, tmp_path):
    def script(messages):
        return f"answer {len(messages)}: {messages[0]['content']}"

    with FakeChatServer(tiny.tokenizer, script=script) as server:
        checks = __import__("collections").Counter()
        got = regenerate(
            _convs(),
            tiny.tokenizer,
            tmp_path / "r.jsonl",
            RegenerationSettings(
                backend="server", max_new_tokens=6, server=_settings(server.url), progress=False
            ),
            token_checks=checks,
        )
    assert len(server.requests) == 12  # every turn of every conversation, in order
    second = [r for r in server.requests if len(r["messages"]) == 3]
    assert {r["messages"][1]["content"] for r in second} == {f"answer 1: question {k}?" for k in range(6)}
    for c in got:
        text = f"answer 3: {c[0]['content']}"
        # the reply and the ids the server generated it as
        assert c[3] == {"role": "assistant", "content": text, "token_ids": tiny.tokenizer(text)["input_ids"]}
    assert checks == {"turns_compared": 12}


def test_requests_spread_over_replicas_and_retry_on_503(tiny, tmp_path):
    with (
        FakeChatServer(tiny.tokenizer, tiny.model, fail_first=2) as a,
        FakeChatServer(tiny.tokenizer, tiny.model) as b,
    ):
        got = regenerate(
            _convs(8),
            tiny.tokenizer,
            tmp_path / "r.jsonl",
            RegenerationSettings(
                backend="server", max_new_tokens=6, server=_settings(a.url, b.url), progress=False
            ),
        )
        assert len(got) == 8 and all(len(c) == 2 for c in got)
        assert len(a.requests) > 2 and len(b.requests) > 0  # both replicas served; a's two 503s were retried


def test_server_errors_name_the_url_and_what_it_said(tiny, tmp_path):
    with FakeChatServer(tiny.tokenizer, tiny.model, fail_first=5) as server:
        with pytest.raises(
            ServerError, match=rf"{server.url}/v1/chat/completions failed 2 times; last: status 503"
        ):
            regenerate(
                _convs(1),
                tiny.tokenizer,
                tmp_path / "a.jsonl",
                RegenerationSettings(
                    backend="server",
                    max_new_tokens=6,
                    server=_settings(server.url, max_retries=1),
                    progress=False,
                ),
            )
    with FakeChatServer(tiny.tokenizer, tiny.model) as server:
        with pytest.raises(ServerError, match="answered 404.*'no-such-model' does not exist"):
            regenerate(
                _convs(1),
                tiny.tokenizer,
                tmp_path / "b.jsonl",
                RegenerationSettings(
                    backend="server",
                    max_new_tokens=6,
                    server=_settings(server.url, model="no-such-model"),
                    progress=False,
                ),
            )
    with pytest.raises(ServerError, match="127.0.0.1:9/v1/models failed 1 times; last: ConnectError"):
        regenerate(
            _convs(1),
            tiny.tokenizer,
            tmp_path / "c.jsonl",
            RegenerationSettings(
                backend="server",
                max_new_tokens=6,
                server=_settings("http://127.0.0.1:9", max_retries=0),
                progress=False,
            ),
        )


def test_a_server_without_token_ids_is_still_used(tiny, tmp_path):
    from collections import Counter

    with FakeChatServer(tiny.tokenizer, tiny.model, token_ids_unsupported=True) as server:
        checks = Counter()
        got = regenerate(
            _convs(2),
            tiny.tokenizer,
            tmp_path / "r.jsonl",
            RegenerationSettings(
                backend="server", max_new_tokens=6, server=_settings(server.url), progress=False
            ),
            token_checks=checks,
        )
        assert all(len(c) == 2 for c in got) and not checks


def test_server_urls_in_the_openai_client_form_reach_the_same_endpoints(tiny, tmp_path):
    # `http://host:8000/v1` is the base URL vLLM's docs give the OpenAI client; it once
    # became /v1/v1/chat/completions (404)
    from eyas.core.engine_process import answers

    with FakeChatServer(tiny.tokenizer, tiny.model) as server:
        for url in (server.url + "/v1", server.url + "/v1/", server.url + "/"):
            assert answers(url)
            got = regenerate(
                _convs(1),
                tiny.tokenizer,
                tmp_path / "r.jsonl",
                RegenerationSettings(
                    backend="server", max_new_tokens=6, server=_settings(url), progress=False
                ),
            )
            assert len(got[0]) == 2
            (tmp_path / "r.jsonl").unlink()
        assert len(server.requests) == 3


@pytest.mark.parametrize("reasoning", ["parsed", "raw"])
def test_harmony_reply_keeps_both_channels_through_storage_rendering_and_masks(tmp_path, reasoning):
    """A GPT-OSS reply with analysis and final channels, from a server that parses them
    (reasoning_content) or one that returns raw harmony text, is stored as reasoning +
    content, re-renders to the tokens generated, and both channels are trained."""
    from collections import Counter

    tok = family_tokenizer("harmony")
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "old"}]
    with FakeChatServer(tok, script=lambda messages: HARMONY_REPLY, reasoning=reasoning) as server:
        checks = Counter()
        (got,) = regenerate(
            [conv],
            tok,
            tmp_path / "r.jsonl",
            RegenerationSettings(
                backend="server", max_new_tokens=6, server=_settings(server.url), progress=False
            ),
            token_checks=checks,
        )
    reply = got[-1]
    assert reply == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning": "The user wants a sum; 2+2 is 4.",
        # the raw reply's ids, without the stop token the template writes
        "token_ids": tok(HARMONY_REPLY, add_special_tokens=False)["input_ids"][:-1],
    }
    stored = json.loads((tmp_path / "r.jsonl").read_text())["messages"][-1]
    assert stored == reply and "<|channel|>" not in stored["content"]
    r = render_with_mask(tok, got)
    masked = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m], skip_special_tokens=False)
    assert "<|channel|>analysis<|message|>The user wants a sum; 2+2 is 4.<|end|>" in masked
    assert "<|channel|>final<|message|>It is 4.<|return|>" in masked and "What is 2+2?" not in masked
    # the re-rendered reply is the token sequence the target generated
    assert checks == Counter({"turns_compared": 1})


def test_hf_decoder_keeps_harmony_channels():
    tok = family_tokenizer("harmony")
    ids = tok(HARMONY_REPLY, add_special_tokens=False)["input_ids"][
        :-1
    ]  # the stop token is not part of a reply
    assert decoded_reply(tok, ids) == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning": "The user wants a sum; 2+2 is 4.",
        "token_ids": ids,
    }
    # a reply cut inside its analysis has no final text: no content, the turn ends the conversation
    cut = tok("<|channel|>analysis<|message|>Let me think", add_special_tokens=False)["input_ids"]
    assert decoded_reply(tok, cut)["content"] == ""
    # plain targets: special tokens skipped, the text kept as the target wrote it (a
    # stripped space would re-tokenize to other ids than the target's)
    plain = family_tokenizer("chatml")
    hi = plain(" hi <|im_end|>", add_special_tokens=False)["input_ids"]
    assert decoded_reply(plain, hi) == {"role": "assistant", "content": " hi ", "token_ids": hi}
    # a reply max_new_tokens cut is marked, so rendering does not end it with an end-of-turn token
    cut = plain("a long", add_special_tokens=False)["input_ids"]
    assert decoded_reply(plain, cut, finished=False) == {
        "role": "assistant",
        "content": "a long",
        "finish_reason": "length",
        "token_ids": cut,
    }


def test_reasoning_parsers():
    assert parse_harmony("no channels at all") == ("", "no channels at all")
    assert parse_harmony("<|channel|>final<|message|>only final<|return|>") == ("", "only final")
    assert split_think("<think>\nwhy\n</think>\n\nbecause") == ("why", "because")
    assert split_think("because") == ("", "because")
    assert assistant_message("<think>w</think> c") == {"role": "assistant", "content": "c", "reasoning": "w"}
    assert assistant_message("c", reasoning="already parsed") == {
        "role": "assistant",
        "content": "c",
        "reasoning": "already parsed",
    }


def test_in_process_vllm_backend_is_refused_with_the_way_out():
    with pytest.raises(RecipeError, match="backend: server with `vllm serve`"):
        recipe_from_dict({"data": {"regenerate": {"backend": "vllm"}}})


def test_prepare_launches_the_engine_regenerates_and_stops_it(tiny_llama_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"messages": c}) for c in _convs(4)) + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_script = Path(__file__).parents[1] / "support" / "fake_openai_server.py"
    launch = f"{sys.executable} {server_script} --target {tiny_llama_dir} --port {port}"
    run = tmp_path / "run"
    args = [
        "prepare",
        "--no-progress",
        f"run_dir={run}",
        f"target.name_or_path={tiny_llama_dir}",
        f"data.sources=[{corpus}]",
        "data.eval_fraction=0",
        "data.regenerate.enabled=true",
        "data.regenerate.backend=server",
        f"data.regenerate.server_urls=[{url}]",
        "data.regenerate.max_new_tokens=6",
        f"data.regenerate.launch={launch}",
    ]
    assert main(args) == 0
    records = [json.loads(line) for line in (run / "prepared" / "regenerated.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["token_checks"]["turns_compared"] == 1 for r in records)
    report = json.loads((run / "prepared" / "drop_report.json").read_text())
    assert report["token_checks"]["turns_compared"] == 4
    from eyas.core.engine_process import answers

    assert not answers(url)  # stopped
    # a finished run does not start the engine again: a launch command that would fail is never run
    assert main(args[:-1] + ["data.regenerate.launch=/bin/false"]) == 0


def test_an_engine_that_dies_is_reported_with_its_log(tmp_path):
    from eyas.core.engine_process import EngineError, launched_engine

    with pytest.raises(EngineError, match=r"exited with code 3 .*\n.*no GPU here"):
        with launched_engine(
            "sh -c 'echo no GPU here; exit 3'",
            [f"http://127.0.0.1:{free_port()}"],
            tmp_path / "engine.log",
            timeout_s=30,
            poll_s=0.05,
        ):
            pass


def test_launch_command_takes_leading_environment_assignments(tmp_path):
    from eyas.core.engine_process import EngineError, launched_engine, split_command

    assert split_command("CUDA_VISIBLE_DEVICES=0,1 VLLM_X='a b' vllm serve m --port 1") == (
        {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_X": "a b"},
        ["vllm", "serve", "m", "--port", "1"],
    )
    assert split_command("vllm serve m --arg=x")[0] == {}  # only leading words set the environment
    with pytest.raises(EngineError, match="names no program"):
        split_command("A=1")
    # the engine really gets them
    with pytest.raises(EngineError, match=r"exited with code 4 .*\n.*devices 2,3"):
        with launched_engine(
            "CUDA_VISIBLE_DEVICES=2,3 sh -c 'echo devices $CUDA_VISIBLE_DEVICES; exit 4'",
            [f"http://127.0.0.1:{free_port()}"],
            tmp_path / "engine.log",
            timeout_s=30,
            poll_s=0.05,
        ):
            pass
