"""The eval's draft-vocabulary coverage: the share of the tokens the target wrote that a
head could propose at all, and the warning when it is low."""

import torch

from eyas.eval.eval_settings import EvalSettings
from eyas.eval.evaluate import run_eval
from eyas.eval.report import format_report
from eyas.eval.speculate import HeadDrafter, greedy_decode
from eyas.eval.workloads import WorkloadPrompt, render_turn
from eyas.heads.algorithms import build_head
from eyas.heads.config import head_config_from_target
from eyas.target.load import load_target, stop_token_ids

DRAFT_VOCAB = 64


def head_over(model, ids: list[int]):
    """A random head whose draft vocabulary is exactly `ids` (sorted, DRAFT_VOCAB of them)."""
    torch.manual_seed(0)
    cfg = head_config_from_target(model.config, aux_layer_ids=[1, 4, 7], draft_vocab_size=DRAFT_VOCAB)
    head = build_head(cfg)
    used = torch.tensor(sorted(ids))
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head.set_vocab_map(used - torch.arange(DRAFT_VOCAB), t2d)
    return head.eval()


def test_the_report_says_how_much_of_the_targets_output_a_head_could_draft(tiny_llama_dir):
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    model, tok = target.model, target.tokenizer
    prompts = [WorkloadPrompt(id=f"p{i}", category="x", turns=[f"count to {i} please"]) for i in range(2)]
    settings = EvalSettings(k=3, max_new_tokens=10)
    eos = stop_token_ids(model, tok)
    written = set()
    for p in prompts:
        written |= set(greedy_decode(model, render_turn(tok, p, []), 10, eos).tokens)
    assert 0 < len(written) < DRAFT_VOCAB
    others = [t for t in range(model.config.vocab_size) if t not in written]
    holds_all = head_over(model, [*written, *others[: DRAFT_VOCAB - len(written)]])
    holds_none = head_over(model, others[:DRAFT_VOCAB])
    half = sorted(written)[: len(written) // 2]
    holds_half = head_over(model, [*half, *others[: DRAFT_VOCAB - len(half)]])
    drafters = {
        n: HeadDrafter(h) for n, h in (("all", holds_all), ("none", holds_none), ("half", holds_half))
    }
    body = run_eval(model, tok, prompts, drafters, settings, progress=False)
    coverage = body["draft_vocab_coverage"]
    assert coverage["all"] == 1.0 and coverage["none"] == 0.0 and 0.0 < coverage["half"] < 1.0
    assert body["lossless"]["passed"]
    text = format_report({**body, "k": 3, "temperature": 0.0, "target": "t", "workload": "w", "head": None})
    assert "draft vocabulary coverage" in text and "all 100.0%, none 0.0%" in text
    warnings = [
        line for line in text.splitlines() if line.startswith("WARNING") and "draft vocabulary" in line
    ]
    assert (
        len(warnings) == 1 + (coverage["half"] < 0.8) and "none's draft vocabulary holds 0.0%" in warnings[0]
    )
