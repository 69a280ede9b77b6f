"""Reasoning as served: the reasoning effort each conversation is regenerated at (a seeded
mix), sent to the server as vLLM takes it and rendered by the real templates (GPT-OSS's
`Reasoning:` line, Qwen3's thinking off); sampling from the target's generation_config;
records that never outlive a change of these settings."""

import json
from collections import Counter
from dataclasses import replace

import pytest
from support.fake_openai_server import FakeChatServer
from support.real_formats import gpt_oss_tokenizer, qwen3_tokenizer

from eyas.data.reasoning import draw_efforts
from eyas.data.regenerate import regenerate
from eyas.data.regenerate_settings import RegenerationSettings, ServerSettings
from eyas.data.templates import prompt_ids, render_with_mask

HARMONY_REPLY = (
    "<|channel|>analysis<|message|>Two and two.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)


def _convs(n):
    return [
        [{"role": "user", "content": f"What is {k}+{k}?"}, {"role": "assistant", "content": "old"}]
        for k in range(n)
    ]


def _settings(url, **kw):
    return ServerSettings(urls=[url], concurrency=4, backoff_s=0.01, **kw)


def _masked(tok, r):
    return tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m], skip_special_tokens=False)


def test_an_effort_mix_is_drawn_per_conversation_with_the_seed():
    mix = {"low": 0.4, "medium": 0.4, "high": 0.2}
    drawn = draw_efforts(mix, 3000, seed=0)
    share = Counter(drawn)
    assert set(share) == set(mix)
    assert all(abs(share[k] / 3000 - w) < 0.04 for k, w in mix.items())
    # a conversation's effort depends on the seed and its index only: a resumed run, or
    # one over fewer conversations, draws the same for it
    assert draw_efforts(mix, 100, seed=0) == drawn[:100]
    assert draw_efforts(mix, 100, seed=1) != drawn[:100]
    assert draw_efforts("high", 3, seed=0) == ["high"] * 3
    assert draw_efforts(None, 2, seed=0) == [None, None]


def test_gpt_oss_conversations_are_prompted_and_trained_at_their_effort(tmp_path):
    tok = gpt_oss_tokenizer()
    out = tmp_path / "r.jsonl"
    mix = {"low": 0.5, "high": 0.5}
    with FakeChatServer(tok, script=lambda messages: HARMONY_REPLY, reasoning="parsed") as server:
        checks = Counter()
        got = regenerate(
            _convs(8),
            tok,
            out,
            RegenerationSettings(
                backend="server",
                server=_settings(server.url),
                max_new_tokens=64,
                reasoning_effort=mix,
                seed=3,
                progress=False,
            ),
            token_checks=checks,
        )
    efforts = draw_efforts(mix, 8, seed=3)
    assert set(efforts) == {"low", "high"}
    sent = {r["messages"][0]["content"]: r for r in server.requests}
    records = {json.loads(line)["index"]: json.loads(line) for line in out.read_text().splitlines()}
    for i, conv in enumerate(got):
        body = sent[conv[0]["content"]]
        # as vLLM's chat endpoint takes it, and as template arguments for other servers
        assert body["reasoning_effort"] == efforts[i]
        assert body["chat_template_kwargs"] == {"reasoning_effort": efforts[i], "enable_thinking": True}
        assert "reasoning_effort" not in body["messages"][0]
        assert records[i]["reasoning_effort"] == efforts[i]
        # the sample's context carries the harmony system message the target was prompted with
        r = render_with_mask(tok, conv, "last")
        assert f"Reasoning: {efforts[i]}\n" in r.text and "Reasoning: medium" not in r.text
        assert _masked(tok, r).endswith("<|channel|>final<|message|>It is 4.<|return|>")
    # the server built the prompt eyas renders, effort included
    assert checks["turns_compared"] == 8 and checks["prompt_tokens_differ"] == 0
    with pytest.raises(ValueError, match="'none' is not an effort of harmony"):
        regenerate(
            _convs(1),
            tok,
            tmp_path / "n.jsonl",
            RegenerationSettings(
                backend="server",
                server=_settings(server.url),
                max_new_tokens=64,
                reasoning_effort="none",
                progress=False,
            ),
        )


@pytest.mark.parametrize("effort", ["none", "high"])
def test_qwen3_thinking_is_off_at_effort_none_and_the_empty_block_is_context(tmp_path, effort):
    tok = qwen3_tokenizer()
    with FakeChatServer(tok, script=lambda messages: "The answer is 4.") as server:
        (conv,) = regenerate(
            _convs(1),
            tok,
            tmp_path / "r.jsonl",
            RegenerationSettings(
                backend="server",
                server=_settings(server.url),
                max_new_tokens=64,
                reasoning_effort=effort,
                progress=False,
            ),
        )
        (body,) = server.requests
    assert body["chat_template_kwargs"]["enable_thinking"] is (effort != "none")
    prompt = tok.decode(prompt_ids(tok, conv[:1], effort))
    r = render_with_mask(tok, conv, "last")
    if effort == "none":
        # the template opens the reply with an empty think block: prompt, never trained
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert _masked(tok, r) == "The answer is 4.<|im_end|>"
    else:
        assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(r.input_ids).startswith(prompt)


def test_records_of_other_settings_are_generated_again(tmp_path):
    tok = qwen3_tokenizer()
    out = tmp_path / "r.jsonl"
    with FakeChatServer(tok, script=lambda messages: "Four.") as server:

        def requests(**kw):
            server.requests.clear()
            settings = RegenerationSettings(
                backend="server", server=_settings(server.url), progress=False, **{"max_new_tokens": 64, **kw}
            )
            regenerate(_convs(3), tok, out, settings)
            return len(server.requests)

        assert requests() == 3
        assert requests() == 0  # the same settings: every record is kept
        # any other sampling, length, seed or effort: every conversation is generated again
        for kw in (
            {"temperature": 0.7},
            {"top_p": 0.9},
            {"max_new_tokens": 32},
            {"seed": 5},
            {"reasoning_effort": "high"},
        ):
            assert requests(**kw) == 3, kw
            assert requests(**kw) == 0, kw


def test_the_server_is_asked_for_the_regeneration_settings_length_and_sampling(tmp_path):
    tok = qwen3_tokenizer()
    with FakeChatServer(tok, script=lambda messages: "Four.") as server:
        settings = RegenerationSettings(
            backend="server",
            server=_settings(server.url),
            max_new_tokens=17,
            temperature=0.6,
            top_p=0.95,
            seed=11,
            progress=False,
        )
        regenerate(_convs(2), tok, tmp_path / "r.jsonl", settings)
        bodies = list(server.requests)
    assert [(b["max_tokens"], b["temperature"], b["top_p"]) for b in bodies] == [(17, 0.6, 0.95)] * 2
    # a seed per conversation, drawn from the settings' seed: another seed asks for others
    seeds = {b["seed"] for b in bodies}
    assert len(seeds) == 2
    with FakeChatServer(tok, script=lambda messages: "Four.") as server:
        regenerate(
            _convs(2), tok, tmp_path / "other.jsonl", replace(settings, seed=12, server=_settings(server.url))
        )
        assert not seeds & {b["seed"] for b in server.requests}


def test_sampling_defaults_to_the_targets_generation_config(tiny_llama_dir, tmp_path):
    import shutil

    from eyas.data.prepare import regeneration_settings
    from eyas.recipe import recipe_from_dict

    sampling = tmp_path / "sampling-target"
    shutil.copytree(tiny_llama_dir, sampling)
    config = json.loads((sampling / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.7, top_p=0.8)
    (sampling / "generation_config.json").write_text(json.dumps(config))

    def chosen(target, **rg):
        recipe = recipe_from_dict(
            {"target": {"name_or_path": str(target)}, "data": {"regenerate": {"backend": "server", **rg}}}
        )
        settings = regeneration_settings(recipe, None, tmp_path, progress=False)
        return settings.temperature, settings.top_p

    assert chosen(sampling) == (0.7, 0.8)
    assert chosen(tiny_llama_dir) == (0.0, 1.0)  # a target that does not sample is regenerated greedily
    assert chosen(sampling, temperature=0.0) == (0.0, 0.8)  # the recipe's own value wins
    assert chosen(tmp_path / "missing", temperature=1.0, top_p=0.95) == (1.0, 0.95)


def test_sampled_replies_are_seeded(tiny_llama_dir, tmp_path):
    from eyas.target.load import load_target

    tiny = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")

    def run(seed, name):
        return regenerate(
            _convs(4),
            tiny.tokenizer,
            tmp_path / name,
            RegenerationSettings(batch_size=2, max_new_tokens=8, temperature=1.0, seed=seed, progress=False),
            model=tiny.model,
        )

    assert run(0, "a.jsonl") == run(0, "b.jsonl")
    assert run(0, "a.jsonl") != run(1, "c.jsonl")


def test_the_hf_backend_prompts_and_marks_each_conversation_at_its_effort(tiny_llama_dir, tmp_path):
    from eyas.data.decode import decode_replies_hf
    from eyas.target.load import load_target

    tiny = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    tok = tiny.tokenizer
    # a template that shows the effort, as GPT-OSS's system message does
    tok.chat_template = (
        "Reasoning: {{ reasoning_effort | default('medium') }}\n"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    mix = {"low": 0.5, "high": 0.5}
    got = regenerate(
        _convs(6),
        tok,
        tmp_path / "r.jsonl",
        RegenerationSettings(batch_size=1, max_new_tokens=4, reasoning_effort=mix, seed=2, progress=False),
        model=tiny.model,
    )
    efforts = draw_efforts(mix, 6, seed=2)
    assert set(efforts) == {"low", "high"}
    for conv, effort in zip(got, efforts):
        reply = conv[-1]
        assert reply["reasoning_effort"] == effort
        prompt = prompt_ids(tok, conv[:1], effort)
        assert tok.decode(prompt).startswith(f"Reasoning: {effort}\n")
        (want,) = decode_replies_hf(tiny.model, tok, [prompt], 4, 0.0, 1.0)
        assert reply["token_ids"] == want.token_ids  # generated from the prompt at its effort
        assert render_with_mask(tok, conv, "last").text.startswith(f"Reasoning: {effort}\n")
