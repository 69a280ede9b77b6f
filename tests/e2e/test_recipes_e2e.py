"""Every shipped recipe, end to end at tiny scale: the recipe unchanged but for its target
(a tiny random model of the same architecture class, with the family's real tokenizer and
chat template where one can be had offline), the data size, the reply lengths and the step
count; its own max_length, prompt cap and batch_tokens are kept. prepare
(server regeneration against a fake OpenAI-compatible server backed by the tiny model,
for the recipes that use the server backend) -> capture or online features -> 2 training
steps (eval and a checkpoint at the second) -> export -> export --check -> eval on 2 prompts.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_openai_server import FakeChatServer

from eyas.cli import main
from eyas.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))


def _family(target: str):
    """(tiny architecture, tokenizer factory, stop tokens, what the tokenizer is) for a recipe's target."""
    name = target.lower()
    if "gpt-oss" in name:
        from support.real_formats import gpt_oss_tokenizer

        return (
            "gpt_oss",
            gpt_oss_tokenizer,
            ("<|return|>", "<|call|>"),
            "real o200k_harmony + GPT-OSS template",
        )
    if "qwen3-coder" in name:
        from support.real_formats import qwen3_coder_tokenizer

        return (
            "qwen3_moe",
            qwen3_coder_tokenizer,
            ("<|im_end|>",),
            "real Qwen3 tokenizer + Qwen3-Coder template",
        )
    if "llama-3" in name:
        from support.real_formats import llama3_tokenizer

        return "llama", llama3_tokenizer, ("<|eot_id|>",), "real Llama 3 tokenizer + Llama-3.1 template"
    if "smollm2" in name:
        from transformers import AutoTokenizer

        from eyas.target.load import resolve_target_path

        return (
            "llama",
            lambda: AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m")),
            ("<|im_end|>",),
            "real SmolLM2 tokenizer",
        )
    raise AssertionError(f"no tiny stand-in for target {target!r}: add one here before shipping the recipe")


def _corpus(path: Path, n: int = 8) -> Path:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"Write a short note about topic {k}."},
                {"from": "gpt", "value": "A note."},
                {"from": "human", "value": "Shorter, please."},
                {"from": "gpt", "value": "Note."},
            ]
        }
        for k in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _tiny_recipe_data(
    recipe_name: str, tmp_path: Path, n: int = 6, extra: tuple = ()
) -> tuple[Path, list[str]]:
    """prepare and capture of a recipe on its tiny stand-in (server regeneration against
    the fake engine where the recipe uses the server backend); returns the recipe path and
    the overrides every later stage takes."""
    from support.tiny_targets import build_tiny_model, save_tiny_target

    recipe_path = ROOT / "recipes" / recipe_name
    recipe = load_recipe(recipe_path)
    arch, make_tokenizer, stops, what = _family(recipe.target.name_or_path)
    tokenizer = make_tokenizer()
    target_dir = save_tiny_target(arch, tmp_path / "target", tokenizer=tokenizer, stop_tokens=stops)
    run = tmp_path / "run"
    overrides = [
        f"run_dir={run}",
        f"target.name_or_path={target_dir}",
        f"data.sources=[{_corpus(tmp_path / 'c.jsonl', n)}]",
        f"data.max_samples={n}",
        "data.eval_fraction=0.2",
        # the recipe's own data.max_length and data.regenerate.max_new_tokens; eval's
        # replies cut (a random tiny model never stops, and each eval decodes 3 ways)
        "data.aux_layer_ids=null",
        "train.max_steps=2",
        "train.warmup_steps=1",
        "train.eval_every=2",
        "train.save_every=2",
        "eval.max_prompts=2",
        "eval.max_new_tokens=8",
        *extra,
    ]
    rg = recipe.data.regenerate
    server = None
    if rg.enabled and rg.backend == "server":
        model = build_tiny_model(arch, tokenizer=tokenizer)
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(list(stops))
        # the server's target ends each reply after 12 tokens, as a real one stops well
        # before the recipe's max_tokens; the requests still carry the recipe's own
        server = FakeChatServer(tokenizer, model, reply_tokens=12).__enter__()
        overrides += ["data.regenerate.launch=null", f"data.regenerate.server_urls=[{server.url}]"]
    # a recipe that reads another run's data (data.from_run): that run is made here, by the
    # same recipe with its own data, and the stages after this one read it
    data_run = tmp_path / "data" if recipe.data.from_run else run
    own_data = [f"run_dir={data_run}", "data.from_run=null"] if recipe.data.from_run else []
    try:
        for stage in ("prepare", "capture"):
            args = [stage, "--no-progress", "-r", str(recipe_path), *overrides, *own_data]
            assert main(args) == 0, (stage, what)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    if server is not None:
        assert server.requests, "the recipe's regeneration never reached the server"
        assert {r["max_tokens"] for r in server.requests} == {rg.max_new_tokens}, what
    report = json.loads((data_run / "prepared" / "drop_report.json").read_text())
    assert report["kept"] > 0, report
    if recipe.data.from_run:
        overrides.append(f"data.from_run={data_run}")
        for stage in ("prepare", "capture"):  # they only check the other run's data
            assert main([stage, "--no-progress", "-r", str(recipe_path), *overrides]) == 0, stage
        assert not (run / "prepared").exists() and not (run / "cache").exists()
    return recipe_path, overrides


def test_every_regenerating_recipe_leaves_its_prompts_room():
    """The recipe's own lengths (which the tiny runs cut): a regenerated turn's prompt may
    take max_length - max_new_tokens tokens; gpt-oss-120b-eagle3 once left 1, so every
    conversation came back empty. A GPU recipe regenerates at least 8,192 new tokens, room
    for GPT-OSS's reasoning to finish."""
    for name in RECIPES:
        d = load_recipe(ROOT / "recipes" / name).data
        if not d.regenerate.enabled:
            continue
        assert d.max_length - d.regenerate.max_new_tokens >= 128, name
        if not name.startswith("smollm2"):
            assert (
                d.regenerate.max_new_tokens >= 8192 and d.max_length - d.regenerate.max_new_tokens >= 4096
            ), name


def _export_check_eval(recipe_path: Path, overrides: list[str], run: Path) -> None:
    recipe = load_recipe(recipe_path)
    assert main(["export", "-r", str(recipe_path), *overrides]) == 0
    export = run / "export"
    assert main(["export", "--check", str(export)]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == recipe.head.algorithm
    assert (
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        == recipe.head.speculative_tokens
    )
    assert main(["eval", "-r", str(recipe_path), *overrides, "--json"]) == 0


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_recipe_runs_end_to_end_at_tiny_scale(recipe_name, tmp_path):
    recipe_path, overrides = _tiny_recipe_data(recipe_name, tmp_path)
    if load_recipe(recipe_path).train.init_from:
        # the head it continues: an EAGLE-3 head trained and exported on the same tiny target
        source = [f"run_dir={tmp_path / 'source'}", "train.init_from=null", "head.algorithm=eagle3"]
        for stage in ("prepare", "capture", "train", "export"):
            args = ["--no-progress"] if stage != "export" else []
            assert main([stage, *args, "-r", str(recipe_path), *overrides, *source]) == 0, stage
        overrides = [*overrides, f"train.init_from={tmp_path / 'source' / 'export'}"]
    assert main(["train", "--no-progress", "-r", str(recipe_path), *overrides]) == 0
    _export_check_eval(recipe_path, overrides, tmp_path / "run")


def _launch_config(recipe_name: str) -> str:
    """The accelerate config a recipe's header tells users to launch it with."""
    text = (ROOT / "recipes" / recipe_name).read_text()
    m = re.search(r"accelerate launch --config_file (recipes/accelerate/\S+\.yaml)", text)
    assert m, f"{recipe_name} names no accelerate config in its header"
    return m.group(1)


GPU_RECIPES = [r for r in RECIPES if not r.startswith("smollm2")]
# one recipe per accelerate config the GPU recipes use, each run with that config
LAUNCHED = sorted({_launch_config(r): r for r in reversed(GPU_RECIPES)}.items())


@pytest.mark.slow
@pytest.mark.parametrize("config,recipe_name", LAUNCHED, ids=[c for c, _ in LAUNCHED])
def test_gpu_recipe_trains_under_its_accelerate_config_on_two_cpu_processes(config, recipe_name, tmp_path):
    if "deepspeed" in config:
        pytest.importorskip("deepspeed")
    # enough samples and small enough batches that each of the 2 processes gets its own
    recipe_path, overrides = _tiny_recipe_data(recipe_name, tmp_path, n=24, extra=("train.batch_tokens=128",))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / config),
        "--num_processes",
        "2",
        "-m",
        "eyas.train",
        "-r",
        str(recipe_path),
        "--no-progress",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "training on 2 process(es)" in out
    assert (tmp_path / "run" / "checkpoints" / "final" / "head.safetensors").is_file()
    _export_check_eval(recipe_path, overrides, tmp_path / "run")
