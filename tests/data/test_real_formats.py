"""The flagship families' real tokenizers (built from quicktok's exact ranks) and chat
templates: exactness of the conversion, and loss masks on multi-turn conversations with
reasoning, rendered the way each real template does."""

import pytest
from support.real_formats import gpt_oss_tokenizer, llama3_tokenizer, qwen3_coder_tokenizer, qwen3_tokenizer

from eyas.data.templates import render_with_mask

TEXTS = [
    "héllo  wörld\n\n\t  x",
    "日本語のテキスト 🤖🚀 مرحبا",
    "def f(x):\n    return x**2  # ok\n\n\n",
    "I'm sure they'll've DONE it's 12345678 times",
    "   leading spaces and trailing   ",
    "a\r\nb\rc",
]
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "reasoning": "greet back"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4.", "reasoning": "add them"},
]


@pytest.mark.parametrize(
    "make,encoding",
    [(gpt_oss_tokenizer, "o200k_harmony"), (qwen3_tokenizer, "qwen3"), (llama3_tokenizer, "llama3")],
)
def test_built_tokenizers_equal_the_reference_encoders(make, encoding):
    import quicktok

    from eyas.data.conversations import read_conversations

    tok, ref = make(), quicktok.get_encoding(encoding)
    convs, _ = read_conversations(["sharegpt"], max_samples=60)
    texts = TEXTS + [m["content"] for c in convs for m in c][:150]
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in texts] == [
        ref.encode_ordinary(t) for t in texts
    ]
    assert len(tok) == ref.n_vocab
    assert tok.decode(tok("<|im_end|>" if "qwen" in encoding else "x")["input_ids"]) in ("<|im_end|>", "x")


def _masked(tok, r):
    segs, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            segs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    return segs + ([tok.decode(cur, skip_special_tokens=False)] if cur else [])


def test_gpt_oss_real_template_masks_both_channels_of_the_last_reply():
    tok = gpt_oss_tokenizer()
    r = render_with_mask(tok, CONV, "all")
    first, last = _masked(tok, r)
    # earlier turns: the template drops their analysis, so only the final channel is there
    assert "greet back" not in r.text and first == "<|channel|>final<|message|>Hello!<|end|>"
    # the last reply: analysis and final channel, as the target generates them, up to <|return|>
    assert last == (
        "<|channel|>analysis<|message|>add them<|end|><|start|>assistant"
        "<|channel|>final<|message|>4.<|return|>"
    )
    assert "Be brief." in r.text and "Reasoning: medium" in r.text  # system -> developer instructions
    assert [s for s in _masked(tok, render_with_mask(tok, CONV, "last"))] == [last]


def test_qwen3_real_template_strips_earlier_think_and_masks_the_last():
    tok = qwen3_tokenizer()
    r = render_with_mask(tok, CONV, "all")
    first, last = _masked(tok, r)
    assert "greet back" not in r.text and first == "Hello!<|im_end|>"
    assert last == "<think>\nadd them\n</think>\n\n4.<|im_end|>"


def test_qwen3_coder_real_template_has_no_reasoning():
    tok = qwen3_coder_tokenizer()
    r = render_with_mask(tok, CONV, "all")
    assert _masked(tok, r) == ["Hello!<|im_end|>", "4.<|im_end|>"] and "add them" not in r.text


@pytest.mark.parametrize(
    "make", [gpt_oss_tokenizer, qwen3_tokenizer, qwen3_coder_tokenizer, llama3_tokenizer]
)
def test_a_reply_cut_at_max_new_tokens_ends_where_the_target_stopped(make):
    """A regenerated reply cut at max_new_tokens (`finish_reason: length`): the sample ends
    at its last content token, with no end-of-turn token the target never produced, and the
    tokens before it are those of the same reply rendered whole."""
    tok = make()
    cut = dict(CONV[-1], content="4, because two and", finish_reason="length")
    whole = render_with_mask(tok, CONV[:-1] + [dict(cut, finish_reason=None)], "last")
    r = render_with_mask(tok, CONV[:-1] + [cut], "last")
    (last,) = _masked(tok, r)
    assert last.endswith("4, because two and") and r.loss_mask[-1] == 1
    assert r.input_ids == whole.input_ids[: len(r.input_ids)] and len(r.input_ids) < len(whole.input_ids)
    assert "finish_reason" not in r.text
