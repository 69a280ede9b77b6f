"""The time budget (eyas/budget/): the choice from measured rates, and the probe on a
tiny target, whose regenerated replies prepare keeps."""

import json
from dataclasses import replace

import pytest
from support.tiny_targets import TINY_LAYERS

from eyas.budget import BudgetError, Rates, choose, estimate, parse_duration, report
from eyas.budget.sizing import FEWEST_EPOCHS
from eyas.cli import main
from eyas.data.fed_states import FED_STATES_DIR, FedStates
from eyas.data.prepare import load_prepared
from eyas.recipe import load_recipe

QUICKSTART = "recipes/smollm2-135m-eagle3.yaml"


def test_durations():
    assert parse_duration("30m") == 1800
    assert parse_duration("1.5h") == 5400
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90
    assert parse_duration("45") == 45
    for bad in ("", "half an hour", "30 minutes", "0m", "-5m", "5x"):
        with pytest.raises(BudgetError, match="budget"):
            parse_duration(bad)


def rates(speed: float = 1.0) -> Rates:
    """Rates of a machine `speed` times slower than a quickstart-like one."""
    return Rates(
        conversations_read=5400,
        deduped=5400,
        regenerable=4000,
        probe_positions=tuple(range(0, 512, 2)),
        regen_batch_s=35.0 * speed,
        samples_per_conversation=0.98,
        sample_tokens=185.0,
        samples_per_step=7.9,
        step_s=0.37 * speed,
        later_step_s=0.30 * speed,
        train_warmup_s=5.0 * speed,
        capture_s_per_token=1.2e-4 * speed,
        uncopied_share=0.05,
        decode_s_per_token=0.044 * speed,
        untrained_spec_s_per_token=0.057 * speed,
        untrained_replay_s_per_token=0.012 * speed,
        stage_start_s=5.0,
        read_s=3.0,
        target_load_s=2.0,
    )


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(QUICKSTART, [])


def total(r, recipe, n, e) -> float:
    return sum(estimate(r, recipe, n, e).values())


def test_estimates_grow_with_conversations_and_epochs(recipe):
    r = rates()
    base = estimate(r, recipe, 2000, 2)
    more = estimate(r, recipe, 4000, 2)
    longer = estimate(r, recipe, 2000, 4)
    assert more["prepare"] > base["prepare"] and more["train"] > base["train"]
    assert longer["prepare"] == base["prepare"] and longer["train"] > 1.5 * (base["train"] - 15.0)
    # later epochs cost their own (cheaper) step
    slower_later = estimate(replace(r, later_step_s=r.step_s), recipe, 2000, 4)
    assert slower_later["train"] > longer["train"] and estimate(
        replace(r, later_step_s=r.step_s), recipe, 2000, 1
    ) == estimate(r, recipe, 2000, 1)
    assert base["eval"] == more["eval"] > 0
    # the probe's batch is already regenerated: prepare does the rest only
    assert estimate(r, recipe, 5400, 4)["prepare"] == pytest.approx(10.0 + (4000 - 256) / 256 * 35.0)


def test_prepare_is_estimated_to_regenerate_what_the_probe_left_of_the_conversations_read(recipe):
    # reading 400 conversations keeps the 200 probe replies among the first 400, and no more:
    # the rest of the 400's regenerable ones are prepare's work
    r = rates()
    regenerable = 4000 * 400 / 5400
    assert estimate(r, recipe, 400, 4)["prepare"] == pytest.approx(10.0 + (regenerable - 200) / 256 * 35.0)


def test_only_prepare_pays_for_reading_the_conversations_and_export_for_no_target(recipe):
    # reading ShareGPT took a minute of a slow machine's probe; counting it in every stage
    # left four minutes of a 30-minute quickstart unused
    slow_read = replace(rates(), read_s=60.0)
    est, base = estimate(slow_read, recipe, 2000, 2), estimate(rates(), recipe, 2000, 2)
    assert est["prepare"] == pytest.approx(base["prepare"] + 57.0)
    assert all(est[k] == base[k] for k in ("capture", "train", "export", "eval"))
    slow_load = estimate(replace(rates(), target_load_s=30.0), recipe, 2000, 2)
    assert all(slow_load[k] == pytest.approx(base[k] + 28.0) for k in ("prepare", "capture", "train", "eval"))
    assert slow_load["export"] == base["export"] == rates().stage_start_s


def test_conversations_read_count_their_repeats_as_max_samples_does(recipe):
    # 5,400 read are 5,000 once repeats are dropped: reading 400 leaves ~370, so only the
    # probe's replies among the first ~370 left are kept, and ~274 are regenerable
    r = replace(rates(), deduped=5000, regenerable=3700)
    left = 5000 * 400 / 5400
    kept = sum(p < left for p in r.probe_positions)
    assert kept == 186
    regenerable = 3700 * 400 / 5400
    assert estimate(r, recipe, 400, 4)["prepare"] == pytest.approx(10.0 + (regenerable - kept) / 256 * 35.0)


def test_a_machine_that_fits_the_recipe_runs_it_unchanged(recipe):
    r = rates()
    c = choose(r, recipe, left_s=2 * total(r, recipe, 5400, 4))
    assert (c.max_samples, c.epochs) == (5400, 4.0)
    assert c.overrides == ["data.max_samples=5400", "train.epochs=4"]


def test_a_slower_machine_reads_fewer_conversations_first(recipe):
    r = rates(speed=1.5)
    left = total(rates(), recipe, 5400, 4)  # what the recipe takes at speed 1
    c = choose(r, recipe, left)
    assert c.epochs == 4.0 and 1350 <= c.max_samples < 5400
    assert sum(c.estimates.values()) <= left
    assert total(r, recipe, c.max_samples + 100, 4) > left  # not needlessly small
    assert any("fewer conversations first" in x for x in c.reasons)


def test_a_much_slower_machine_then_trains_fewer_epochs(recipe):
    r = rates(speed=3.5)
    left = total(rates(), recipe, 5400, 4)
    c = choose(r, recipe, left)
    # conversations down to a quarter of the recipe's before an epoch goes
    assert c.max_samples == 1350 and 1.0 <= c.epochs < 4.0
    assert sum(c.estimates.values()) <= left
    assert c.epochs * 4 == int(c.epochs * 4)  # quarters


def test_a_still_slower_machine_keeps_three_epochs_over_fewer_conversations(recipe):
    # below a quarter of the recipe's conversations, a head seen three times over fewer
    # conversations beats one seen once over more (docs/experiments.md, 2026-12-07)
    left = total(rates(), recipe, 5400, 4)
    r = rates(speed=4.5)
    c = choose(r, recipe, left)
    assert c.epochs == FEWEST_EPOCHS == 3.0 and 256 <= c.max_samples < 1350
    assert sum(c.estimates.values()) <= left
    assert total(r, recipe, c.max_samples + 50, 3.0) > left  # not needlessly small
    # one epoch only once the probe's batch of conversations does not fit three
    slowest = choose(rates(speed=8.0), recipe, left)
    assert slowest.max_samples == 256 and slowest.epochs < 3.0
    assert total(rates(speed=8.0), recipe, 256, 3.0) > left


def test_an_impossible_budget_is_said(recipe):
    c = choose(rates(speed=50.0), recipe, left_s=300)
    assert c.epochs == 1.0 and c.max_samples <= 1350
    assert any("cannot be met" in x for x in c.reasons)


def test_keys_the_user_set_are_kept(recipe):
    r = rates(speed=3.5)
    left = total(rates(), recipe, 5400, 4)
    c = choose(r, recipe, left, fixed=("data.max_samples",))
    assert c.max_samples == 5400 and c.epochs < 4.0
    c = choose(r, recipe, left, fixed=("train.epochs",))
    assert c.epochs == 4.0 and c.max_samples < 1350


def test_the_report_sets_each_stage_against_its_estimate_and_share():
    sized = {
        "budget_s": 1800,
        "spent_before_s": 60,
        "probe_s": 50,
        "estimates_s": {"prepare": 500, "train": 700},
    }
    text = report(sized, {"setup": 60, "sizing": 50, "prepare": 540, "train": 650})
    rows = {line.split()[0]: line.split() for line in text.splitlines()}
    assert rows["prepare"][1:4] == ["9.0m", "8.3m", "30%"]
    assert rows["train"][1:4] == ["10.8m", "11.7m", "36%"]
    assert "within the budget of 30 min" in rows["total"][-1] or "within" in text
    over = report(sized, {"prepare": 2000})
    assert "OVER the budget" in over


def test_probe_sizes_the_run_and_prepare_keeps_its_replies(tiny_llama_dir, tmp_path, capsys, caplog):
    rows = [
        {
            "conversations": [
                # every eighth row repeats the prompt before it: dropped, yet counted by max_samples
                {
                    "from": "human",
                    "value": f"question {k - (k % 8 == 7)} " + "word " * ((k - (k % 8 == 7)) % 13),
                },
                {"from": "gpt", "value": "an answer"},
            ]
        }
        for k in range(160)
    ]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = tmp_path / "run"
    common = [
        f"run_dir={run}",
        f"target.name_or_path={tiny_llama_dir}",
        f"data.sources=[{corpus}]",
        "data.max_samples=160",
        "data.regenerate.batch_size=16",
        "data.regenerate.max_new_tokens=8",
        "data.max_length=96",
        "head.draft_vocab_size=64",
        "data.aux_layer_ids=[1,2,3]",
        "target.dtype=float32",
    ]
    assert (
        main(["budget", "--no-progress", "-r", QUICKSTART, "--budget", "20m", "--spent", "30", *common]) == 0
    )
    out = capsys.readouterr()
    sized = json.loads((run / "budget.json").read_text())
    # max_samples was set by the user: only the epochs are sized, and printed for the stages
    assert out.out.split() == sized["overrides"] == ["train.epochs=4"]
    assert "estimated" in out.err and sized["spent_before_s"] == 30
    assert sized["other_load_during_probe"] is None or sized["other_load_during_probe"] >= 0
    r = sized["rates"]
    assert len(r["probe_positions"]) == 16 and r["regen_batch_s"] > 0 and r["step_s"] > 0
    assert (r["conversations_read"], r["deduped"]) == (160, 140)
    assert (
        r["decode_s_per_token"] > 0
        and r["untrained_spec_s_per_token"] > 0
        and r["untrained_replay_s_per_token"] > 0
        and r["samples_per_step"] >= 1
        and r["sample_tokens"] > 10
    )
    regenerated = run / "prepared" / "regenerated.jsonl"
    probe_records = regenerated.read_text().splitlines()
    assert len(probe_records) == 16
    # the probe's batch lies among the first two batches read, and its positions are those
    assert sorted(json.loads(x)["index"] for x in probe_records) == r["probe_positions"]
    assert max(r["probe_positions"]) < 2 * 16
    # a rerun with the same budget reuses the sizing instead of measuring again
    caplog.clear()
    with caplog.at_level("INFO", logger="eyas.budget"):
        assert main(["budget", "--no-progress", "-r", QUICKSTART, "--budget", "20m", *common]) == 0
    assert "using the sizing" in caplog.text
    assert regenerated.read_text().splitlines() == probe_records
    # prepare continues after the probe's replies: each conversation regenerated once
    assert main(["prepare", "--no-progress", "-r", QUICKSTART, *common, *sized["overrides"]]) == 0
    lines = regenerated.read_text().splitlines()
    assert lines[:16] == probe_records and len(lines) == 140
    assert len({json.loads(x)["index"] for x in lines}) == 140
    # the capture's share of recomputed samples is the one the probe measured on its batch
    probe_indices = {json.loads(x)["index"] for x in probe_records}
    fed = FedStates(run / "prepared" / FED_STATES_DIR, [1, 2, 3, TINY_LAYERS], str(tiny_llama_dir))
    rows = [
        fed.states_for(c, x, m) is None
        for split in load_prepared(run / "prepared").values()
        for c, x, m in zip(split["conversation"], split["input_ids"], split["loss_mask"])
        if c in probe_indices
    ]
    assert len(rows) >= 12 and r["uncopied_share"] == pytest.approx(sum(rows) / len(rows))
    capsys.readouterr()
    assert (
        main(
            [
                "budget",
                "-r",
                QUICKSTART,
                "--budget",
                "20m",
                "--report",
                "setup=30",
                "prepare=12.5",
                f"run_dir={run}",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "prepare" in table and "within the budget of 20 min" in table
    assert json.loads((run / "budget.json").read_text())["took_s"] == {"setup": 30.0, "prepare": 12.5}


def test_the_probe_counts_the_samples_the_capture_would_run_again(tmp_path):
    """A sample whose tokens part from what regeneration fed before its last reply token
    is captured by running the target; the probe's share counts exactly those."""
    import torch

    from eyas.budget.probe import _uncopied_share
    from eyas.data.fed_states import write_fed_states
    from eyas.data.regenerate_settings import RegenerationSettings

    fed = {c: ([1, 2, 3, 4, 5], torch.zeros(5, 4)) for c in (10, 11, 12, 13)}
    write_fed_states(tmp_path, fed, [1, 2], "t")
    settings = RegenerationSettings(states_dir=tmp_path, state_layer_ids=[1, 2], target_name="t")
    masks = [[0, 0, 1, 1, 1]] * 4
    same, parted = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]  # re-encoded differently inside the reply
    assert _uncopied_share(settings, [10, 11, 12, 13], [same, same, parted, same], masks) == 0.25
    # a conversation the regeneration kept no states for is run too
    assert _uncopied_share(settings, [10, 11, 12, 99], [same] * 4, masks) == 0.25


def test_the_budget_needs_a_limit_to_size(tiny_llama_dir, tmp_path, capsys):
    assert (
        main(
            [
                "budget",
                "-r",
                QUICKSTART,
                "--budget",
                "20m",
                f"run_dir={tmp_path}/run",
                f"target.name_or_path={tiny_llama_dir}",
                "data.max_samples=null",
            ]
        )
        == 1
    )
    assert "data.max_samples" in capsys.readouterr().err
    assert main(["budget", "-r", QUICKSTART, "--budget", "soon"]) == 2
    assert "30m" in capsys.readouterr().err


def test_stdout_holds_only_the_overrides_whatever_the_probe_prints(monkeypatch, capfd, tmp_path):
    """The quickstart passes each stdout line to every stage as an override: a library's
    notice printed during the probe (DeepSpeed writes one to fd 1) must not get there."""
    import os
    import sys

    import eyas.budget

    def noisy(recipe, budget_s, spent_s, fixed, progress=True):
        print("[WARNING] Setting accelerator to CPU.")
        sys.stdout.flush()
        os.write(1, b"raw notice on fd 1\n")
        return {"overrides": ["data.max_samples=1350", "train.epochs=1.5"], "reasons": ["estimated 21.7 min"]}

    monkeypatch.setattr(eyas.budget, "size_run", noisy)
    assert main(["budget", "--no-progress", "-r", QUICKSTART, "--budget", "30m", f"run_dir={tmp_path}"]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines() == ["data.max_samples=1350", "train.epochs=1.5"]
    assert "Setting accelerator to CPU" in err and "raw notice on fd 1" in err


def test_a_run_on_another_runs_data_sizes_only_its_epochs():
    # the P-EAGLE quickstart reads the EAGLE-3 quickstart's data (data.from_run): nothing to
    # regenerate or capture, the reused train samples are what they are
    recipe = load_recipe("recipes/smollm2-135m-peagle.yaml", [])
    r = replace(
        rates(speed=3.0),
        conversations_read=5184,
        deduped=5184,
        regenerable=5184,
        samples_per_conversation=1.0,
    )
    est = estimate(r, recipe, 5184, 2)
    assert est["prepare"] == est["capture"] == r.stage_start_s and est["train"] > 600
    left = est["train"] * 0.6 + 4 * r.stage_start_s + est["eval"]
    c = choose(r, recipe, left)
    assert c.max_samples == 5184 and 1.0 <= c.epochs < 2.0 and c.epochs * 4 == int(c.epochs * 4)
    assert sum(c.estimates.values()) <= left


def test_the_probe_batch_takes_a_real_batchs_lengths():
    import torch

    from eyas.train.step_timing import synthetic_batch

    gen = torch.Generator().manual_seed(0)
    batch = synthetic_batch(3, 9, 50, 12, 4, "cpu", gen, lengths=[9, 4, 7])
    assert batch["attention_mask"].sum(1).tolist() == [9, 4, 7]
    assert batch["input_ids"].shape == (3, 9) and batch["aux"].shape == (3, 9, 12)
    # the loss mask stays inside each real stretch
    assert bool((batch["loss_mask"] <= batch["attention_mask"]).all()) and int(batch["loss_mask"].sum()) > 0
    with pytest.raises(ValueError, match="do not describe"):
        synthetic_batch(3, 9, 50, 12, 4, "cpu", gen, lengths=[8, 4, 7])


def test_a_busy_cpu_is_said_with_the_way_to_size_again(tmp_path):
    from eyas.budget.sizing import busy_reason

    path = tmp_path / "budget.json"
    said = busy_reason(1.9, 2, path)
    assert "kept 1.9 of 2 cores busy" in said and str(path) in said
    assert busy_reason(0.4, 2, path) is None  # an idle 2-core machine
    assert busy_reason(3.0, 16, path) is None  # a busy core of sixteen leaves the rates near
    assert busy_reason(None, 2, path) is None  # no /proc/stat on this platform


def test_the_load_of_other_processes_leaves_out_the_probes_own_work():
    import subprocess
    import sys
    import time

    from eyas.budget.sizing import cpu_seconds, other_load

    if cpu_seconds() is None:
        pytest.skip("no /proc/stat here")

    def loads(work):
        before, start = cpu_seconds(), time.perf_counter()
        work()
        return other_load(before, cpu_seconds(), time.perf_counter() - start)

    def spin():  # this process's own work: a probe measuring
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass

    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = loads(spin)  # another process spinning beside it (not waited for)
    finally:
        other.kill()
        other.wait()
    # the other process keeps about a core busy; the probe's own core is not counted
    assert busy > 0.5
    assert loads(spin) < 0.5  # alone: its own spinning is no other load
    # readings that are missing say nothing
    assert other_load(None, (1.0, 1.0), 1.0) is None


@pytest.mark.parametrize("recipe_path", [QUICKSTART, "recipes/smollm2-135m-peagle.yaml"])
def test_the_probe_times_the_evals_speculative_pass_with_an_untrained_head(tiny_llama_dir, recipe_path):
    # what the eval's second pass costs at its slowest, for the recipe's own head algorithm
    from eyas.budget.probe import _decode_seconds_per_token
    from eyas.target.load import load_target

    recipe = load_recipe(
        recipe_path,
        [f"target.name_or_path={tiny_llama_dir}", "head.draft_vocab_size=64", "data.aux_layer_ids=[1,2,3]"],
    )
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    conversation = [{"role": "user", "content": "Name three colours."}]
    plain, speculative, replayed = _decode_seconds_per_token(recipe, target, target.tokenizer, conversation)
    assert 0 < plain and 0 < speculative and 0 < replayed


def test_the_eval_estimate_decodes_the_head_on_eval_decoded_prompts_and_replays_it_elsewhere():
    quick = load_recipe(
        QUICKSTART, ["eval.max_prompts=10", "eval.max_new_tokens=100", "eval.decoded_prompts=2"]
    )
    r, start = rates(), 5.0 + 2.0  # a stage's process start and the target's load
    per_turn = 100 * (
        10 * r.decode_s_per_token + 2 * r.untrained_spec_s_per_token + 8 * r.untrained_replay_s_per_token
    )
    assert estimate(r, quick, 2000, 3)["eval"] == pytest.approx(start + 2 * per_turn)  # MT-bench: 2 turns
    # every prompt decoded: unset, or sampled (a replay needs greedy)
    for overrides in (["eval.decoded_prompts=null"], ["eval.temperature=1.0"]):
        every = load_recipe(QUICKSTART, ["eval.max_prompts=10", "eval.max_new_tokens=100", *overrides])
        all_decoded = 2 * 100 * 10 * (r.decode_s_per_token + r.untrained_spec_s_per_token)
        assert estimate(r, every, 2000, 3)["eval"] == pytest.approx(start + all_decoded)


def test_a_stages_target_load_is_timed_without_what_the_machine_does_once(monkeypatch):
    # the first load of a machine also times bf16 against float32 for dtype auto and caches
    # the choice; a stage's own load reads it, so the probe leaves the measuring out
    import eyas.budget.probe as probe
    from eyas.core import precision

    clock, loads = [0.0], []

    def load(section, work_rows):
        loads.append(work_rows)
        clock[0] += 5.0
        if len(loads) == 1:  # the machine's first verdict, measured inside the load
            clock[0] += 60.0
            monkeypatch.setattr(precision, "_measuring_s", precision.measuring_seconds() + 60.0)
        return f"target {len(loads)}"

    monkeypatch.setattr("eyas.target.load.load_recipe_target", load)
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    assert probe._timed_load(object(), 256) == ("target 1", 5.0)
    assert probe._timed_load(object(), 256) == ("target 2", 5.0)
    assert loads == [256, 256]


def test_training_is_limited_to_what_export_and_eval_leave_of_the_budget(tmp_path, capsys):
    # the machine slowed after the probe and prepare ran late: training gets what is left
    # once export and eval have their estimates, so the run still ends inside the budget
    run = tmp_path / "run"
    run.mkdir()
    estimates = {"prepare": 217.0, "capture": 10.0, "train": 622.0, "export": 5.0, "eval": 289.0}
    (run / "budget.json").write_text(json.dumps({"estimates_s": estimates}))
    common = ["budget", "-r", QUICKSTART, "--budget", "30m", "--train-limit"]
    assert main([*common, "--spent", "816", f"run_dir={run}"]) == 0  # 13.6 of the 30 minutes gone
    assert capsys.readouterr().out.split() == [f"train.max_minutes={(1800 - 816 - 5 - 289) / 60:.2f}"]
    assert main([*common, "--spent", "1700", f"run_dir={run}"]) == 0  # nothing left: a minute all the same
    assert capsys.readouterr().out.split() == ["train.max_minutes=1.00"]
    # the user's own limit stands
    assert main([*common, "--spent", "816", f"run_dir={run}", "train.max_minutes=20"]) == 0
    assert capsys.readouterr().out == ""
    (run / "budget.json").unlink()
    assert main([*common, "--spent", "816", f"run_dir={run}"]) == 1
    assert "size the run first" in capsys.readouterr().err
