"""The package foundation: CLI, recipes, the import direction of DESIGN §1."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.cli import STAGES, build_parser, main
from eyas.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]


def test_eyas_help_lists_every_stage():
    out = subprocess.run(
        [sys.executable, "-m", "eyas", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for stage in STAGES:
        assert stage in out


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_has_help(stage, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([stage, "--help"])
    assert exc.value.code == 0
    assert stage in capsys.readouterr().out


def test_no_stage_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_import_from_any_directory(tmp_path):
    code = "import eyas.heads, eyas.export, eyas.data, eyas.train, eyas.eval, eyas.recipe; print('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "ok"


def _imported_modules(path: Path, package: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


# Above every stage: the recipe module and the command line that wire the stages together.
ABOVE = ("eyas.recipe", "eyas.cli", "eyas.commands")


@pytest.mark.parametrize(
    "folder,forbidden",
    [
        (
            "core",
            ("eyas.target", "eyas.data", "eyas.heads", "eyas.export", "eyas.train", "eyas.eval", *ABOVE),
        ),
        ("target", ("eyas.data", "eyas.heads", "eyas.export", "eyas.train", "eyas.eval", *ABOVE)),
        # The models import no file format: export/ reads and writes them, never the reverse.
        ("heads", ("eyas.export", "eyas.data", "eyas.train", "eyas.eval", *ABOVE)),
        ("export", ("eyas.data", "eyas.train", "eyas.eval", *ABOVE)),
        ("data", ("eyas.heads", "eyas.export", "eyas.train", "eyas.eval", *ABOVE)),
        ("train", ("eyas.eval", *ABOVE)),
        ("eval", ("eyas.train", *ABOVE)),
    ],
)
def test_import_direction(folder, forbidden):
    """Data flows data -> train -> heads -> export -> eval; only eyas.cli wires every stage;
    the frozen target (eyas.target) and the shared helpers (eyas.core) import no stage; a
    stage reads its settings from the recipe it is handed, never imports the recipe module
    (a run's file names are eyas.core.run_paths)."""
    bad = []
    for path in sorted((ROOT / folder).glob("*.py")):
        if path.name == "__main__.py":
            continue  # `python -m eyas.train` is a CLI entry point
        for mod in _imported_modules(path, f"eyas.{folder}"):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


# Every package folder and the import name it maps to (pyproject.toml, package-dir).
PACKAGES = {
    "eyas": "eyas",
    "eyas/commands": "eyas.commands",
    "eyas/budget": "eyas.budget",
    "core": "eyas.core",
    "target": "eyas.target",
    "data": "eyas.data",
    "heads": "eyas.heads",
    "export": "eyas.export",
    "train": "eyas.train",
    "eval": "eyas.eval",
}


def test_no_two_modules_import_each_other():
    """Shared types live in a neutral module (DESIGN §1): a reader never goes from one
    module to another and back. Imports inside functions and for type checking count too,
    and so does `from package import module`."""
    imports = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found = _imported_modules(path, package)
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.update(f"{node.module}.{a.name}" for a in node.names)
            imports[name] = found
    loops = sorted(
        f"{a} <-> {b}" for a, found in imports.items() for b in found if a < b and a in imports.get(b, ())
    )
    assert loops == KNOWN_LOOPS, "\n".join(loops)


# conversations.py reads rows with json_rows.py, which names its DropReport for type checking only.
KNOWN_LOOPS = ["eyas.data.conversations <-> eyas.data.json_rows"]


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)


def test_recipe_without_room_for_a_prompt_is_refused_naming_both_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  max_length: 2048\n  regenerate: {enabled: true, max_new_tokens: 2048}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    msg = str(err.value)
    assert str(path) in msg and "data.regenerate.max_new_tokens" in msg and "data.max_length" in msg
    assert load_recipe(path, ["data.max_length=4096"]).data.max_length == 4096


def test_unknown_key_names_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  learning_rat: 1e-4\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(f)
    msg = str(exc.value)
    assert "train.learning_rat" in msg and str(f) in msg


def test_overrides_are_typed_and_checked():
    r = recipe_from_dict(
        {"train": {"learning_rate": 1e-4}},
        overrides=["train.learning_rate=3e-4", "data.sources=[a.json, b.json]", "head.num_layers=2"],
    )
    assert r.train.learning_rate == 3e-4
    assert r.data.sources == ["a.json", "b.json"]
    assert r.head.num_layers == 2
    with pytest.raises(RecipeError, match="train.nope"):
        recipe_from_dict({}, overrides=["train.nope=1"])
    with pytest.raises(RecipeError, match="key.sub=value"):
        recipe_from_dict({}, overrides=["train.learning_rate"])


def test_exclusive_norm_options_rejected():
    with pytest.raises(RecipeError, match="exclude"):
        recipe_from_dict({"head": {"fc_norm": True, "norm_before_fc": True}})


def test_algorithm_keys_live_in_their_section_and_flat_keys_name_the_new_one():
    with pytest.raises(
        RecipeError, match=r"train\.copy_attention_weight is now train\.eagle3\.copy_attention_weight"
    ):
        recipe_from_dict({"train": {"copy_attention_weight": 1.0}})
    with pytest.raises(RecipeError, match=r"train\.num_depths is now train\.peagle\.num_depths"):
        recipe_from_dict({}, overrides=["train.num_depths=4"])
    with pytest.raises(RecipeError, match=r"unknown key 'train\.peagle\.num_depth'"):
        recipe_from_dict({"train": {"peagle": {"num_depth": 4}}})
    with pytest.raises(
        RecipeError, match="head.algorithm: unknown algorithm 'eagle4'; known: eagle3, peagle"
    ):
        recipe_from_dict({"head": {"algorithm": "eagle4"}})
    with pytest.raises(RecipeError, match="copy_attention_weight"):
        recipe_from_dict({"train": {"eagle3": {"copy_attention_weight": -1.0}}})
    # the selected algorithm's section is written out with its defaults (recipe.yaml, settings)
    tree = recipe_from_dict({"head": {"algorithm": "peagle"}}).model_dump(mode="json")
    assert tree["train"]["peagle"]["num_depths"] == 8 and "eagle3" not in tree["train"]
    recipe = recipe_from_dict({"train": {"eagle3": {"copy_attention_weight": 1.0}}})
    assert recipe.train.section("eagle3").copy_attention_weight == 1.0
    with pytest.raises(RecipeError, match="copy_attention_steps"):
        recipe_from_dict(
            {"train": {"eagle3": {"copy_attention_weight": 1.0, "ttt_steps": 3, "copy_attention_steps": 4}}}
        )


def test_packaged_file_names_the_install_command(tmp_path):
    from eyas.core.assets import packaged_file

    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-eyas-pkg"):
        packaged_file("no_such_eyas_pkg", "x.json", "no-such-eyas-pkg")
    # a present package but a missing file names the file
    with pytest.raises(FileNotFoundError, match="missing"):
        packaged_file("eyas", "no/such/file.txt", "eyas")
    assert packaged_file("eyas", "recipe.py", "eyas").is_file()


@pytest.mark.parametrize(
    "override",
    [
        "train.grad_accum=0",
        "train.max_steps=-3",
        "train.max_steps=0",
        "train.epochs=0",
        "train.epochs=-1",
        "train.batch_tokens=0",
        "train.learning_rate=-1e-4",
        "train.learning_rate=0",
        "train.betas=[0.9, 1.5]",
        "train.warmup_steps=-1",
        "train.save_every=-1",
        "train.eval_every=-5",
        "train.keep_checkpoints=-1",
        "train.peagle.cod_r=1.5",
        "train.eagle3.ttt_steps=0",
        "data.eval_fraction=-0.1",
        "data.eval_fraction=1",
        "data.eval_fraction=1.5",
        "data.max_length=0",
        "data.max_samples=0",
        "data.aux_layer_ids=[2, -1]",
        "data.capture_batch_tokens=0",
        "head.num_layers=0",
        "head.draft_vocab_size=0",
        "head.hidden_size=0",
        "head.speculative_tokens=0",
        "head.speculative_tokens=1000",
        "eval.k=0",
        "eval.k=500",
        "eval.max_new_tokens=0",
        "eval.temperature=-1",
        "eval.ngram_min=0",
        "data.regenerate.concurrency=0",
    ],
)
def test_out_of_range_values_fail_at_load_naming_key_and_file(override, tmp_path):
    """A bad number fails when the recipe loads (before any target is loaded), with the
    key and the file in the message, not deep inside a stage."""
    f = tmp_path / "r.yaml"
    f.write_text("train:\n  learning_rate: 1.0e-4\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(f, overrides=[override])
    key = override.split("=")[0]
    assert key in str(exc.value) and str(f) in str(exc.value), str(exc.value)


def test_in_range_edges_load():
    r = recipe_from_dict(
        {},
        overrides=[
            "data.eval_fraction=0",
            "train.warmup_steps=0",
            "train.max_grad_norm=0",
            "train.max_steps=1",
            "head.speculative_tokens=64",
            "train.betas=[0, 0.999]",
        ],
    )
    assert r.data.eval_fraction == 0 and r.train.max_grad_norm == 0 and r.head.speculative_tokens == 64
    with pytest.raises(RecipeError, match="ngram_max .* below eval.ngram_min"):
        recipe_from_dict({"eval": {"ngram_min": 6, "ngram_max": 3}})


def test_a_second_writer_of_a_run_dir_is_refused_naming_the_first(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from eyas.run_lock import claim_run_dir\n"
            f"claim_run_dir({str(run)!r}, 'train'); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["prepare", f"run_dir={run}", "data.sources=[nothing.jsonl]"]) == 3
        err = capsys.readouterr().err
        assert f"run dir {run} is in use by PID {holder.pid} (eyas train)" in err
    finally:
        holder.kill()
        holder.wait()
    # the lock goes with its process, however it ended; the next command gets past it
    assert main(["prepare", f"run_dir={run}", "data.sources=[nothing.jsonl]"]) != 3
    assert "in use" not in capsys.readouterr().err


def test_known_failures_print_one_line_naming_the_thing(tmp_path, tiny_llama_dir, capsys):
    import yaml
    from support.train_run_fixtures import prepare_run

    recipe = prepare_run(tmp_path, tiny_llama_dir, "offline", n=8, max_steps=1)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    manifest = next(recipe.paths.cache.rglob("manifest.json"))
    manifest.write_text(manifest.read_text()[:40])  # cut off, as by a full disk
    capsys.readouterr()
    assert main(["train", "--no-progress", "-r", str(path)]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("eyas train: ") and str(manifest) in last, err[-2000:]
    assert "eyas capture" in last
    # -v: the traceback, for a bug report
    from eyas.data.cache import DamagedShardError

    with pytest.raises(DamagedShardError):
        main(["-v", "train", "--no-progress", "-r", str(path)])


def test_a_full_disk_is_said_in_words():
    import errno

    from eyas.cli import known_failure

    assert "no space left" in known_failure(OSError(errno.ENOSPC, "No space left on device", "/run/ckpt/x"))
    assert "disk full" in known_failure(
        RuntimeError(
            "[enforce fail at inline_container.cc:664] . unexpected pos "
            "PytorchStreamWriter failed writing file data/0"
        )
    )
    assert known_failure(ValueError("a bug")) is None


# What safetensors 0.8 raises when the disk fills during save_file (its Rust io::Error, Debug-printed).
SAFETENSORS_DISK_FULL = (
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
)


def test_a_full_disk_while_safetensors_writes_a_checkpoint_is_one_line(
    tmp_path, tiny_llama_dir, capsys, caplog, monkeypatch
):
    """The second checkpoint fails to write as on a full disk: `eyas train` says so in one
    line (before: a SafetensorError traceback), the first checkpoint is kept and a rerun
    resumes from it to the end."""
    import logging

    import yaml
    from safetensors import SafetensorError
    from support.train_run_fixtures import prepare_run

    import eyas.train.checkpoint as ckpt

    recipe = prepare_run(tmp_path, tiny_llama_dir, "online", n=8, max_steps=4, save_every=2, eval_every=0)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    real_save = ckpt.save_file

    def disk_full_after_the_first_checkpoint(tensors, filename, *args, **kwargs):
        if ckpt.list_checkpoints(recipe.paths.checkpoints):
            raise SafetensorError(SAFETENSORS_DISK_FULL)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", disk_full_after_the_first_checkpoint)
    capsys.readouterr()
    assert main(["train", "--no-progress", "-r", str(path)]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("eyas train: no space left on the device"), err[-2000:]
    assert [step for step, _ in ckpt.list_checkpoints(recipe.paths.checkpoints)] == [2]
    monkeypatch.setattr(ckpt, "save_file", real_save)
    caplog.set_level(logging.INFO)
    assert main(["train", "--no-progress", "-r", str(path)]) == 0
    assert "(step 2)" in caplog.text and "resumed from" in caplog.text
    assert (recipe.paths.checkpoints / "final").is_dir()


def test_an_unreachable_hub_is_said_in_words():
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    from eyas.cli import known_failure

    for err in (
        OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/models/o/n: offline mode is enabled."),
        LocalEntryNotFoundError("Cannot find the requested files in the disk cache"),
    ):
        line = known_failure(err)
        assert (
            "Hub cannot be reached" in line and str(err).splitlines()[0] in line and "local directory" in line
        )


def test_offline_hub_names_are_one_line_saying_what_to_do(tmp_path, tiny_llama_dir, capsys):
    """The tests run offline: a Hub target or dataset not in the local cache is said in one
    line (what is missing, how to get it), never a retry traceback."""
    convs = tmp_path / "c.jsonl"
    convs.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
    )
    cases = [
        (
            [f"data.sources=[{convs}]", "target.name_or_path=someorg/not-cached-model"],
            ["target 'someorg/not-cached-model'", "not in the local Hugging Face cache", "hf download"],
        ),
        (
            ["data.sources=[someorg/not-cached-data]", f"target.name_or_path={tiny_llama_dir}"],
            ["data source 'someorg/not-cached-data'", "cannot load it as a Hugging Face dataset", "local"],
        ),
    ]
    for overrides, said in cases:
        capsys.readouterr()
        assert main(["prepare", "--no-progress", f"run_dir={tmp_path / 'run'}", *overrides]) == 1
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and last.startswith("eyas prepare: "), err[-2000:]
        assert all(s in last for s in said), last
    assert not (tmp_path / "run" / "prepared" / "meta.json").exists()
