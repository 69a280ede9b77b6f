"""The serving planner: the expected-length formula, the roofline's shape, and the
published P-EAGLE vs EAGLE-3 gains from published sizes."""

import json
import re

import pytest

from eyas.cli import main
from eyas.core.acceptance import expected_tokens_per_step
from eyas.eval.planner import plan
from eyas.eval.sizes import HARDWARE, TARGETS, head_size, parse_target

ACC = [0.8, 0.75, 0.72, 0.7, 0.68, 0.66, 0.65]


def best(p, b):
    return p.speedup[b][p.best_k[b]]


def test_dense_target_speedup_falls_with_concurrency_and_stops_paying():
    t = TARGETS["llama-3.1-8b"]
    p = plan(
        ACC, HARDWARE["H200"], t, head_size(t, "eagle3"), context=1024, concurrency=[1, 4, 16, 64, 256, 1024]
    )
    curve = [best(p, b) for b in p.concurrency]
    assert curve[0] > 1.5
    assert all(
        b <= a + 1e-9 for a, b in zip(curve[2:], curve[3:])
    )  # falls once the verify pass turns compute-bound
    assert curve[0] > curve[-1]
    assert p.breakeven_concurrency is not None and curve[-1] <= 1.0
    # the best K shrinks as the batch grows
    assert p.best_k[p.concurrency[-2]] <= p.best_k[1]


def test_speedup_uses_the_expected_length_formula():
    t = TARGETS["llama-3.1-8b"]
    hw = HARDWARE["H100"]
    a = [0.9] * 8
    p = plan(a, hw, t, head_size(t, "peagle"), concurrency=[1])
    q = plan([0.5] * 8, hw, t, head_size(t, "peagle"), concurrency=[1])
    for k in (1, 4, 8):  # same costs, so the speedup ratio is the ratio of E_K
        assert p.speedup[1][k] / q.speedup[1][k] == pytest.approx(
            expected_tokens_per_step(a[:k]) / expected_tokens_per_step([0.5] * k)
        )


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "qwen3-coder-30b-a3b"])
def test_peagle_over_eagle3_reproduces_the_published_shape(name):
    """Published P-EAGLE gains over EAGLE-3 on B200: ~1.55-1.69x at concurrency 1,
    ~1.05-1.25x at 64, same K = 7 and the same acceptance."""
    t, hw = TARGETS[name], HARDWARE["B200"]
    pe = plan(ACC, hw, t, head_size(t, "peagle", 4), concurrency=[1, 4, 16, 64])
    e3 = plan(ACC, hw, t, head_size(t, "eagle3"), concurrency=[1, 4, 16, 64])
    ratio = [pe.speedup[b][7] / e3.speedup[b][7] for b in pe.concurrency]
    assert all(b <= a + 1e-9 for a, b in zip(ratio, ratio[1:]))
    assert 1.25 < ratio[0] < 1.8
    assert 1.0 < ratio[-1] < 1.3
    if name == "gpt-oss-20b":
        assert 1.5 < ratio[0] < 1.75


def test_parse_target_sizes():
    assert parse_target("GPT-OSS-20B").active_params < parse_target("gpt-oss-20b").total_params
    t = parse_target(
        "total_params=7e9,num_layers=32,hidden_size=4096,num_heads=32,num_kv_heads=8,head_dim=128,vocab_size=32000"
    )
    assert t.active_params == 7e9 and t.num_layers == 32
    with pytest.raises(ValueError, match="unknown target"):
        parse_target("gpt-5")
    with pytest.raises(ValueError, match="unknown target field"):
        parse_target("total_params=1e9,layers=3")


def test_plan_cli_prints_inputs_config_and_writes_png(tmp_path, capsys):
    report = {"algorithm": "peagle", "drafters": {"head": {"per_position_acceptance": [0.8, 0.7, 0.6, None]}}}
    path = tmp_path / "eval_report.json"
    path.write_text(json.dumps(report))
    rc = main(
        [
            "plan",
            "--report",
            str(path),
            "--hardware",
            "B200",
            "--target-params",
            "gpt-oss-120b",
            "--out",
            str(tmp_path),
            "run_dir=" + str(tmp_path / "run"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "hardware B200" in out and "gpt-oss-120b" in out and "acceptance a_k: 0.800, 0.700, 0.600" in out
    config = json.loads(out.split("--speculative-config '")[1].split("'")[0])
    assert config["parallel_drafting"] is True and 1 <= config["num_speculative_tokens"] <= 8
    assert (tmp_path / "plan.png").stat().st_size > 1000
    rc = main(
        [
            "plan",
            "--acceptance",
            "0.7,0.6",
            "--hardware",
            "L4",
            "--target-params",
            "llama-3.1-8b",
            "--compare",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    body = json.loads(capsys.readouterr().out)
    assert set(body["plans"]) == {"eagle3", "peagle"}


def test_plan_cli_serves_the_head_the_report_measured(tmp_path, capsys):
    import json

    from eyas.cli import main

    report = {
        "algorithm": "eagle3",
        "head": "runs/my-head/export",
        "drafters": {"head": {"per_position_acceptance": [0.8, 0.7, 0.6]}},
    }
    path = tmp_path / "eval_report.json"
    path.write_text(json.dumps(report))
    assert (
        main(
            [
                "plan",
                "--report",
                str(path),
                "--hardware",
                "H200",
                "--target-params",
                "llama-3.1-8b",
                "--out",
                str(tmp_path / "plan"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"model": "runs/my-head/export"' in out and (tmp_path / "plan" / "plan.png").is_file()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--acceptance", "0.7,1.3"], r"acceptances must be numbers in \[0, 1\]"),
        (["--acceptance", "0.7,-0.1"], r"acceptances must be numbers in \[0, 1\]"),
        (["--acceptance", "0.7,x"], "expected numbers"),
        (["--acceptance", "0.7", "--concurrency", "1,0"], "--concurrency values must be at least 1"),
        (["--acceptance", "0.7", "--concurrency", "1,two"], "expected whole numbers"),
        (["--acceptance", "0.7", "--max-k", "0"], "--max-k must be at least 1"),
        (["--acceptance", "0.7", "--max-k", "500"], "--max-k must be at most 64"),
        (["--acceptance", "0.7", "--context", "0"], "--context must be at least 1"),
    ],
)
def test_plan_names_the_bad_flag(flags, message, tmp_path, capsys):
    argv = ["plan", *flags, "--hardware", "H200", "--target-params", "llama-3.1-8b", "--out", str(tmp_path)]
    assert main(argv) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("eyas plan: ") and re.search(message, last), last


@pytest.mark.parametrize(
    "content", ["", "{not json", "[1, 2]", '{"drafters": {"head": {"per_position_acceptance": [0.5, 7]}}}']
)
def test_plan_names_a_damaged_report(content, tmp_path, capsys):
    path = tmp_path / "eval_report.json"
    path.write_text(content)
    assert (
        main(
            [
                "plan",
                "--report",
                str(path),
                "--hardware",
                "H200",
                "--target-params",
                "llama-3.1-8b",
                "--out",
                str(tmp_path),
            ]
        )
        == 1
    )
    assert str(path) in capsys.readouterr().err


def test_plan_for_a_head_that_never_pays_says_do_not_speculate(tmp_path, capsys):
    """Acceptance so low that no K pays at any concurrency: no --speculative-config is
    recommended (before: K=1), the line says do not speculate and why; --json holds null."""
    flags = ["plan", "--acceptance", "0.05", "--hardware", "H200", "--target-params", "llama-3.1-8b"]
    assert main([*flags, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--speculative-config" not in out
    line = next(x for x in out.splitlines() if x.startswith("do not speculate at concurrency 1:"))
    assert "nor at any other concurrency planned" in line and "acceptance 0.05" in line
    assert "do not speculate: no drafter beats plain decoding at any K and concurrency" in out
    assert main([*flags, "--out", str(tmp_path), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["speculative_config"] == {"eagle3": None} and body["do_not_speculate"]["eagle3"] == line
    assert body["recommendation"]["command_at_lowest_concurrency"] is None


def test_a_heads_measured_terms_price_its_passes_and_leave_the_target_alone():
    """`draft_pass_overhead` / `draft_layer_latency` (H200's come from scripts/bench_draft.py)
    replace the shared fixed terms in the draft passes only: K chained passes pay them K
    times, a P-EAGLE pass once; the target's pass is priced as before."""
    from dataclasses import replace

    from eyas.eval.planner import draft_time, target_time

    t = TARGETS["gpt-oss-20b"]
    base = replace(HARDWARE["H100"], pass_overhead=300e-6, layer_latency=50e-6)
    measured = replace(base, draft_pass_overhead=40e-6, draft_layer_latency=130e-6)
    e3, pe = head_size(t, "eagle3", 1), head_size(t, "peagle", 4)
    for k in (3, 7):
        assert draft_time(base, e3, 1, k, 2048) - draft_time(measured, e3, 1, k, 2048) == pytest.approx(
            k * ((300e-6 + 50e-6) - (40e-6 + 130e-6))
        )
        assert draft_time(base, pe, 1, k, 2048) - draft_time(measured, pe, 1, k, 2048) == pytest.approx(
            (300e-6 + 4 * 50e-6) - (40e-6 + 4 * 130e-6)
        )
    assert target_time(base, t, 8, 4, 2048) == target_time(measured, t, 8, 4, 2048)
    assert HARDWARE["H200"].draft_pass_overhead is not None
