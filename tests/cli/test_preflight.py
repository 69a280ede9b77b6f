"""`eyas preflight`: every shipped recipe sized from its target's config alone (meta
device, no weights), the GPU recipes on the hardware their headers state, a recipe that
cannot fit refused with the stage, the bytes and the knob, and the same check ahead of
`eyas prepare` / `eyas train` on the GPUs they find."""

import json
import re
from pathlib import Path

import pytest

from eyas.cli import main
from eyas.preflight import parse_gpu, preflight
from eyas.preflight_check import fits_table, header_hardware
from eyas.preflight_plan import GB
from eyas.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GPU_RECIPES = [p for p in RECIPES if header_hardware(p.read_text())]
BIG = ROOT / "recipes" / "gpt-oss-120b-eagle3.yaml"


def test_every_gpu_recipe_states_its_hardware():
    # the recipes whose target needs a GPU node: every one names what it was sized for
    named = {p.name for p in RECIPES if not p.name.startswith("smollm2")}
    assert named and named == {p.name for p in GPU_RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_fits_what_its_header_states(path, capsys):
    hw = header_hardware(path.read_text())
    args = ["preflight", "-r", str(path), "--json"]
    assert main(args) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["gpu"] == (hw["gpu"] if hw else "H100-80")
    train = next(s for s in plan["stages"] if s["stage"] == "train")
    assert 0 < train["peak"] <= train["budget"] and train["seconds_per_mtok"] > 0


def test_the_120b_recipe_on_four_40gb_gpus_names_stage_bytes_and_knob(capsys):
    assert main(["preflight", "-r", str(BIG), "--gpu", "A100-40", "--gpus", "4"]) == 1
    err = capsys.readouterr().err
    assert "stage train needs" in err and "GB per rank of 36.0 GB" in err
    assert "target's weights alone (65.2 GB)" in err  # MXFP4 kept: 116.8 B parameters in ~65 GB
    # the engine's TP 2 x DP 4 launch needs 8 GPUs: named with its knob
    assert "stage regenerate" in err and "--tensor-parallel-size" in err


def test_activations_over_the_budget_name_the_batch_tokens_that_fit():
    recipe = load_recipe(BIG)
    p = preflight(recipe, "H100-80", 8)
    train = next(s for s in p.stages if s.stage == "train")
    assert not train.fits
    fit = int(re.search(r"at most (\d+)", train.knob).group(1))
    smaller = load_recipe(
        BIG,
        [f"train.batch_tokens={fit}", f"data.max_length={fit}", f"data.regenerate.max_new_tokens={fit // 2}"],
    )
    assert next(s for s in preflight(smaller, "H100-80", 8).stages if s.stage == "train").fits


def test_dequantized_mxfp4_is_sized_in_bf16_and_does_not_fit_an_h200():
    kept = preflight(load_recipe(BIG), "H200", 8)
    bf16 = preflight(load_recipe(BIG, ["target.dequantize=true"]), "H200", 8)
    w_kept = next(s for s in kept.stages if s.stage == "train").per_rank["target weights"]
    w_bf16 = next(s for s in bf16.stages if s.stage == "train").per_rank["target weights"]
    assert 60 * GB < w_kept < 70 * GB and 225 * GB < w_bf16 < 240 * GB
    assert "bfloat16" in bf16.weights and not bf16.fits
    assert "target.dequantize: false" in next(s for s in bf16.stages if s.stage == "train").knob


def test_the_attention_that_will_run_is_named():
    # GPT-OSS's sinks: a fused flex kernel on the GPU it is sized for, not eager
    assert preflight(load_recipe(BIG), "H200", 8).attention == "flex_attention"
    llama = ROOT / "recipes" / "llama-3.1-8b-eagle3.yaml"
    assert preflight(load_recipe(llama), "H100-80", 8).attention == "sdpa"
    eager = preflight(load_recipe(BIG, ["target.attn_implementation=eager"]), "H200", 8)
    train = next(s for s in eager.stages if s.stage == "train")
    assert "target attention scores (eager)" in train.per_rank and not eager.fits


def test_an_engine_shorter_than_max_length_is_refused():
    recipe = load_recipe(BIG)
    launch = recipe.data.regenerate.launch.replace("--max-model-len 16384", "--max-model-len 8192")
    p = preflight(load_recipe(BIG, [f"data.regenerate.launch={launch}"]), "H200", 8)
    regen = next(s for s in p.stages if s.stage == "regenerate")
    assert not regen.fits and "--max-model-len" in regen.knob


def test_the_fits_table_of_docs_distributed_is_preflights_output():
    doc = (ROOT / "docs" / "distributed.md").read_text()
    table = doc.split("<!-- preflight table -->\n")[1].split("\n<!-- /preflight table -->")[0]
    assert table == fits_table([str(p) for p in RECIPES])


def test_gpu_profiles_come_from_the_planner():
    assert parse_gpu("H100-80").memory_bytes == 80 * GB
    assert parse_gpu("H200").memory_bytes == 141e9
    with pytest.raises(ValueError, match="unknown GPU"):
        parse_gpu("Z9")


def test_a_local_config_wins_and_a_missing_one_says_how_to_get_it(tmp_path, tiny_llama_dir):
    from eyas.target.shapes import ShapeError, config_file

    assert config_file(str(tiny_llama_dir)) == Path(tiny_llama_dir) / "config.json"
    with pytest.raises(ShapeError, match="hf download no-such/model"):
        config_file("no-such/model")
    from eyas.target.shapes import target_shape

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    with pytest.raises(ShapeError, match="cannot build its no_such_arch config"):
        target_shape(str(tmp_path))


def test_train_refuses_before_loading_when_the_gpus_found_are_too_small(monkeypatch, tmp_path, capsys):
    import eyas.preflight_check as check

    monkeypatch.setattr(check, "local_gpus", lambda: ("A100-40", 4, 1))
    run = [f"run_dir={tmp_path}/r"]
    assert main(["train", "-r", str(BIG), *run]) == 1
    err = capsys.readouterr().err
    assert "stage train needs" in err and "--no-preflight" in err
    assert "stage regenerate" not in err  # train checks its own stage
    # skipped: the stage goes on and stops at its first missing input instead
    assert main(["train", "-r", str(BIG), "--no-preflight", *run]) == 1
    assert "stage train needs" not in capsys.readouterr().err


def test_the_vllm_capture_backend_holds_no_target_copy_and_checks_its_launch_line():
    """data.capture.backend=vllm: the capture stage holds the target's weights split over the
    engine's TP instead of a whole copy per rank, plus the engine's KV and states per
    sequence; a launch line the node cannot hold is refused naming data.capture.launch."""
    offline = ["data.features=offline"]
    hf = next(s for s in preflight(load_recipe(BIG, offline), "H200", 8).stages if s.stage == "capture")
    launch = "vllm serve openai/gpt-oss-120b -tp 8 --max-model-len 16384"
    over = [*offline, "data.capture.backend=vllm", f"data.capture.launch={launch}"]
    cap = next(s for s in preflight(load_recipe(BIG, over), "H200", 8).stages if s.stage == "capture")
    assert "target weights" not in cap.per_rank and cap.fits
    assert cap.per_rank["target weights / TP"] == pytest.approx(hf.per_rank["target weights"] / 8)
    assert any(k.startswith("KV + states of") for k in cap.per_rank)
    too_wide = [*over[:2], f"data.capture.launch={launch.replace('-tp 8', '-tp 16')}"]
    bad = next(s for s in preflight(load_recipe(BIG, too_wide), "H200", 8).stages if s.stage == "capture")
    assert not bad.fits and "data.capture.launch" in bad.knob


def test_engine_features_plan_no_target_copy_per_rank_and_the_engine_beside_the_ranks():
    """data.features=engine: the train stage holds no target weights (online's does), the
    engine stage its weights over TP; an engine eyas launches on the ranks' GPUs leaves
    them only what --gpu-memory-utilization does not take, and says what to change."""
    online = preflight(load_recipe(BIG, ["data.features=online"]), "H200", 8)
    on_train = next(s for s in online.stages if s.stage == "train")
    url = ["data.features=engine", "data.capture.server_url=http://engine:8000"]
    plan = preflight(load_recipe(BIG, url), "H200", 8)
    train = next(s for s in plan.stages if s.stage == "train")
    engine = next(s for s in plan.stages if s.stage == "engine")
    assert "target weights" in on_train.per_rank and "target weights" not in train.per_rank
    assert train.peak < on_train.peak and train.budget == on_train.budget
    assert any("no target copy per rank" in n for n in train.notes)
    assert "runs elsewhere" in engine.notes[0] and not any(s.stage == "capture" for s in plan.stages)
    assert not plan.disk  # no feature cache
    launch = "vllm serve openai/gpt-oss-120b -tp 8 --max-model-len 16384"
    beside = preflight(load_recipe(BIG, [*url[:1], f"data.capture.launch={launch}"]), "H200", 8)
    tr = next(s for s in beside.stages if s.stage == "train")
    assert "target weights / TP" in next(s for s in beside.stages if s.stage == "engine").per_rank
    assert tr.budget < 0.11 * train.budget and not tr.fits
    assert "data.capture.server_url" in tr.knob


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_head_optimizer_state_is_sized_as_the_trainer_builds_it(optimizer):
    """The GPT-OSS-20B head built on the meta device: gradients for every trainable weight,
    AdamW's two moments, or under Muon one buffer per hidden matrix and AdamW's two for the
    LM head (train/optimizers.py decides which)."""
    import torch
    from transformers import AutoConfig

    from eyas.heads.algorithms import build_head
    from eyas.target.shapes import target_shape
    from eyas.train.build import head_config_for
    from eyas.train.optimizers import muon_parameter

    recipe = load_recipe(ROOT / "recipes" / "gpt-oss-20b-eagle3.yaml", [f"train.optimizer={optimizer}"])
    config = AutoConfig.for_model(**target_shape(recipe.target.name_or_path).config)
    head_cfg = head_config_for(recipe, config)
    with torch.device("meta"):
        head = build_head(head_cfg)
    trained = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    if optimizer == "muon":
        moments = sum(p.numel() * (4 if muon_parameter(n, p) else 8) for n, p in trained)
    else:
        moments = sum(p.numel() * 8 for _, p in trained)
    built = sum(p.numel() * 4 for _, p in trained) + moments

    train = next(s for s in preflight(recipe, "H100-80", 8).stages if s.stage == "train")
    (sized,) = [v for k, v in train.per_rank.items() if k.startswith("head gradients")]
    assert sized == pytest.approx(built, rel=0.01)
