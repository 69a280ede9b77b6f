"""Token-exact replies: a reply stored with the token ids the target generated is trained as
those ids, even where its text would tokenise otherwise (a split the target sampled that
the tokenizer merges), on the real GPT-OSS, Qwen3 and Llama 3.1 templates; through the
server backend's `return_token_ids` and the hf backend alike."""

from collections import Counter

import pytest
from support.fake_openai_server import FakeChatServer
from support.real_formats import gpt_oss_tokenizer, llama3_tokenizer, qwen3_tokenizer

from eyas.data.regenerate import regenerate
from eyas.data.regenerate_settings import RegenerationSettings, ServerSettings
from eyas.data.templates import prompt_ids, render_with_mask, special_strings

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "reasoning": "greet back"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris.", "reasoning": "geography"},
]


def _specials(tok) -> set[int]:
    return set(tok.convert_tokens_to_ids(special_strings(tok)))


def _masked_ids(r) -> list[int]:
    return [t for t, m in zip(r.input_ids, r.loss_mask) if m]


def _split_one_token(tok, ids: list[int]) -> list[int]:
    """`ids` with one word token replaced by two tokens of its halves: text that decodes the
    same and that the tokenizer itself would never produce."""
    for j, t in enumerate(ids):
        s = tok.decode([t])
        if len(s.strip()) >= 4 and s.strip().isalpha():
            halves = (
                tok(s[:2], add_special_tokens=False)["input_ids"]
                + tok(s[2:], add_special_tokens=False)["input_ids"]
            )
            return ids[:j] + halves + ids[j + 1 :]
    raise AssertionError("no word token to split")


@pytest.mark.parametrize("make", [gpt_oss_tokenizer, qwen3_tokenizer, llama3_tokenizer])
def test_a_reply_with_its_token_ids_trains_those_ids(make):
    tok = make()
    specials = _specials(tok)
    canonical = render_with_mask(tok, CONV, "last")
    masked = _masked_ids(canonical)
    n_end = next(i for i in range(len(masked)) if masked[-1 - i] not in specials)
    body, end = masked[: len(masked) - n_end], masked[len(masked) - n_end :]
    sampled = _split_one_token(tok, body)
    assert sampled != body and tok.decode(sampled) == tok.decode(body)
    # the same text, stored with the ids the target generated (and the stop token an engine returns)
    reply = dict(CONV[-1], token_ids=sampled + end[-1:])
    r = render_with_mask(tok, CONV[:-1] + [reply], "last")
    assert _masked_ids(r) == sampled + end
    # the context is the prompt the target was given, token for token
    first = r.loss_mask.index(1)
    assert r.input_ids[:first] == prompt_ids(tok, CONV[:-1])
    assert r.input_ids[:first] == canonical.input_ids[: canonical.loss_mask.index(1)]
    # text that is not what the ids decode to (a template that rewrote the turn) keeps the text
    other = render_with_mask(tok, CONV[:-1] + [dict(CONV[-1], token_ids=sampled[:-2])], "last")
    assert other.input_ids == canonical.input_ids and other.loss_mask == canonical.loss_mask


def test_gpt_oss_earlier_turns_whose_analysis_the_template_dropped_render_from_text():
    tok = gpt_oss_tokenizer()
    plain = render_with_mask(tok, CONV, "all")
    ids = {k: prompt_ids(tok, CONV[:k]) for k in (2, 4)}  # any ids: only their text is compared
    with_ids = [dict(m, token_ids=ids[k]) if k in ids else m for k, m in enumerate(CONV)]
    # turn 2's analysis is not in the rendering, so its ids cannot stand for the text there
    assert render_with_mask(tok, with_ids, "all").input_ids == plain.input_ids


def test_server_token_ids_are_stored_and_trained(tmp_path):
    tok = llama3_tokenizer()
    text = "The capital of France is Paris."
    sampled = _split_one_token(tok, tok(text, add_special_tokens=False)["input_ids"])
    conv = [CONV[3], {"role": "assistant", "content": "old"}]
    settings = ServerSettings(urls=[], concurrency=2, backoff_s=0.01)
    with FakeChatServer(tok, script=lambda messages: sampled) as server:
        settings.urls = [server.url]
        checks = Counter()
        (got,) = regenerate(
            [conv],
            tok,
            tmp_path / "r.jsonl",
            RegenerationSettings(backend="server", max_new_tokens=32, server=settings, progress=False),
            token_checks=checks,
        )
    reply = got[-1]
    # the server's ids end with the stop token <|eot_id|>, which the template writes itself
    assert reply["content"] == text and reply["token_ids"] == sampled
    # what is trained is what the target produced: no turn re-tokenises to other ids
    assert checks == Counter({"turns_compared": 1})
    r = render_with_mask(tok, got, "last")
    assert _masked_ids(r)[: len(sampled)] == sampled
    assert "token_ids" not in server.requests[0]["messages"][0]


def test_hf_replies_keep_their_token_ids(tiny_llama_dir, tmp_path):
    from eyas.data.decode import decode_replies_hf
    from eyas.target.load import load_target

    tiny = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    conv = [CONV[3], {"role": "assistant", "content": "old"}]
    (got,) = regenerate(
        [conv],
        tiny.tokenizer,
        tmp_path / "r.jsonl",
        RegenerationSettings(max_new_tokens=6, progress=False),
        model=tiny.model,
    )
    (want,) = decode_replies_hf(
        tiny.model, tiny.tokenizer, [prompt_ids(tiny.tokenizer, conv[:1])], 6, 0.0, 1.0
    )
    assert got[-1]["token_ids"] == want.token_ids
    r = render_with_mask(tiny.tokenizer, got, "last")
    assert _masked_ids(r) == want.token_ids  # cut at max_new_tokens: no end-of-turn token after them
