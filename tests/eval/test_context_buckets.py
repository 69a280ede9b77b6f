"""τ by context length (eval/context_buckets.py), the `longctx` source and workload
(data/longctx.py), and the engine's per-request records put in context buckets."""

from __future__ import annotations

import json

import pytest

from eyas.eval.context_buckets import bucket_labels, context_lines, summarize_by_context
from eyas.eval.request_metrics import records_by_context
from eyas.eval.speculate import DecodeTrace


def test_bucket_labels_name_the_edges():
    assert bucket_labels() == ["<2k", "2k-8k", "8k-32k", ">=32k"]
    assert bucket_labels([100, 300]) == ["<100", "100-300", ">=300"]


def test_each_draft_step_counts_in_the_bucket_of_its_context():
    # K = 2. Steps at contexts 10, 20 (bucket <100) accept 2 and 0; steps at 150, 160
    # (100-300) accept 1 and 1; one step at 400 (>=300) accepts 2.
    a = DecodeTrace(
        tokens=[1] * 9, seconds=1.0, forwards=4, drafted=[2, 2, 2], accepted=[2, 0, 1], contexts=[10, 20, 150]
    )
    b = DecodeTrace(
        tokens=[1] * 5, seconds=1.0, forwards=3, drafted=[2, 2], accepted=[1, 2], contexts=[160, 400]
    )
    out = summarize_by_context([a, b], 2, [100, 300])
    assert list(out) == ["<100", "100-300", ">=300"]
    short, mid, long = out["<100"], out["100-300"], out[">=300"]
    assert (short["steps"], mid["steps"], long["steps"]) == (2, 2, 1)
    assert short["tau"] == pytest.approx((2 + 0 + 2) / 2)
    assert short["per_position_acceptance"] == [0.5, 1.0]
    assert mid["tau"] == pytest.approx(2.0) and mid["per_position_acceptance"] == [1.0, 0.0]
    assert long["tau"] == pytest.approx(3.0) and long["context_range"] == [400, 400]
    assert mid["context_range"] == [150, 160]
    lines = context_lines(
        {"per_context": {"head": out}, "context_buckets": [100, 300], "workload": "w", "k": 2}
    )
    assert lines[0].split()[-3:] == ["<100", "100-300", ">=300"]
    assert lines[1].startswith("head") and "2.00 / 50% / 2" in lines[1]


def test_served_requests_fall_in_the_bucket_of_their_mid_output_context():
    def rec(prompt, output, accepted_per_step):
        return {
            "prompt_tokens": prompt,
            "output_tokens": output,
            "steps": 10,
            "draft_tokens": 30,
            "accepted": 10 * accepted_per_step,
            "histogram": [10 - accepted_per_step * 5, accepted_per_step * 5],
        }

    # 1900 + 300/2 = 2050: the second bucket, though its prompt is under 2k
    out = records_by_context([rec(100, 50, 1), rec(1900, 300, 2), rec(9000, 10, 1)])
    assert list(out) == ["<2k", "2k-8k", "8k-32k"]
    assert out["2k-8k"]["requests"] == 1 and out["2k-8k"]["accepted_per_step"] == 2.0


def test_longctx_splits_are_disjoint_and_reach_long_contexts():
    from eyas.data.conversations import read_conversations
    from eyas.eval.workloads import load_workload

    test = load_workload("longctx:test")
    train, report = read_conversations(["longctx:train"])
    assert report.kept == len(train) > len(test) > 0
    modules = lambda ids: {i.split("@")[0] for i in ids}  # noqa: E731
    assert not modules(p.id for p in test) & modules(r["id"] for r in _rows("longctx:train"))
    assert {p.category for p in test} == {"4k chars", "10k chars", "19k chars", "24k chars"}
    longest = max(len(p.turns[0]) for p in test)
    assert longest > 24_000 and all(p.turns[0].rstrip().endswith("stops.") for p in test)
    assert train[0][1]["role"] == "assistant" and len(train[0][1]["content"]) == 2_000


def _rows(source):
    from eyas.data.longctx import longctx_rows

    return longctx_rows(source)


def test_eval_reports_tau_per_context_bucket(tmp_path, tiny_llama_dir, capsys):
    from test_eval_speculate import random_head

    from eyas.cli import main
    from eyas.heads.io import save_head
    from eyas.target.load import load_target

    wl = tmp_path / "w.jsonl"
    # byte tokens: prompts of ~40 and ~140 tokens, so both buckets get steps
    wl.write_text("\n".join(json.dumps({"prompt": f"say {w} " * n}) for w, n in (("a", 4), ("bee", 20))))
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    save_head(random_head(target.model, "eagle3"), tmp_path / "head")
    args = ["--target", str(tiny_llama_dir), "--workload", str(wl), "--k", "3", "--max-new-tokens", "12"]
    args += ["--no-progress", "target.dtype=float32", "target.device=cpu", "eval.context_buckets=[100]"]
    rc = main(["eval", *args, "--head", str(tmp_path / "head"), "--out", str(tmp_path / "ev"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["context_buckets"] == [100]
    for name in ("head", "ngram"):
        buckets = report["per_context"][name]
        assert list(buckets) == ["<100", ">=100"]
        assert buckets["<100"]["context_range"][1] < 100 <= buckets[">=100"]["context_range"][0]
        assert sum(b["steps"] for b in buckets.values()) == report["drafters"][name]["verify_steps"]
    assert (tmp_path / "ev" / "eval_by_context.png").stat().st_size > 1000
    rc = main(["eval", *args, "--head", str(tmp_path / "head"), "--out", str(tmp_path / "ev2")])
    printed = capsys.readouterr().out
    assert rc == 0 and "by context (tau ± se / a1 / steps)" in printed


def test_tau_standard_error_treats_sequences_as_the_unit():
    """Three sequences of two K=2 steps accepting 4, 0 and 2 tokens: τ = 2; the error of
    a ratio of sums over 3 sequences is sqrt(3/2 · Σ(a - n)²) / 6 = sqrt(12) / 6. Sequences
    that all accept alike have no spread; one sequence has no estimate."""
    from eyas.eval.trace_summary import summarize, tau_standard_error

    def seq(accepted):
        return DecodeTrace(
            tokens=[1], seconds=1.0, forwards=3, drafted=[2, 2], accepted=accepted, contexts=[5, 6]
        )

    traces = [seq([2, 2]), seq([0, 0]), seq([1, 1])]
    assert summarize(traces, 2)["tau"] == pytest.approx(2.0)
    assert tau_standard_error(traces) == pytest.approx(12**0.5 / 6)
    assert summarize(traces, 2)["tau_se"] == pytest.approx(12**0.5 / 6)
    assert tau_standard_error([seq([2, 0]), seq([0, 2])]) == 0.0
    assert tau_standard_error(traces[:1]) is None and "tau_se" not in summarize(traces[:1], 2)
    out = summarize_by_context(traces, 2, [100])
    assert out["<100"]["tau_se"] == pytest.approx(12**0.5 / 6)
    line = context_lines({"per_context": {"head": out}, "context_buckets": [100], "workload": "w", "k": 2})[1]
    assert "2.00 ±0.58 / " in line


def test_paired_tau_difference_cancels_what_the_prompts_share():
    """Two heads over the same three sequences: the second accepts one token more on every
    step of the two easy sequences. Alone each τ spreads with the prompts; paired, the
    difference's error is only how unevenly the gain falls (here the hard sequence gains
    nothing), well under the spread of either τ."""
    from eyas.eval.trace_summary import paired_against_head, paired_tau_difference, tau_standard_error

    def seq(accepted):
        return DecodeTrace(tokens=[1], seconds=1.0, forwards=3, drafted=[3, 3], accepted=accepted)

    base = [seq([2, 2]), seq([0, 0]), seq([2, 2])]
    better = [seq([3, 3]), seq([0, 0]), seq([3, 3])]
    d = paired_tau_difference(better, base)
    # τ 1 + 12/6 = 3 against 1 + 8/6; each easy step gains 1 of 6 steps
    assert d["difference"] == pytest.approx(12 / 6 - 8 / 6)
    # per sequence (accepted - rate · steps) / all steps, ours minus theirs:
    # easy (6 - 2·2)/6 - (4 - 4/3·2)/6 = 1/9, hard (0 - 2·2)/6 - (0 - 4/3·2)/6 = -2/9
    parts = [1 / 9, -2 / 9, 1 / 9]
    assert d["se"] == pytest.approx((3 / 2 * sum(u * u for u in parts)) ** 0.5) == pytest.approx(1 / 3)
    assert d["se"] < tau_standard_error(base) and d["se"] < tau_standard_error(better)
    assert paired_tau_difference(base, base) == {"difference": 0.0, "se": 0.0}
    assert paired_tau_difference(better[:2], base) is None  # not the same sequences
    pairs = paired_against_head({"head": base, "b": better, "ngram": base[:1]})
    assert list(pairs) == ["b"]
    assert paired_against_head({"b": better}) == {}
