"""data.from_run: a run that trains on another run's prepared data and feature cache (the
P-EAGLE quickstart on the EAGLE-3 quickstart's). Its prepare and capture only check that
the data are there and never write into the other run; its training reads them; what is
missing or stale is named."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from support.train_run_fixtures import prepare_run

from eyas.cli import main


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_llama_dir):
    """A prepared and captured run (the one reused)."""
    return prepare_run(tmp_path_factory.mktemp("source"), tiny_llama_dir, "offline", n=24)


def _reuser(source, tmp_path: Path, from_run: Path, **head) -> Path:
    tree = source.model_dump(mode="json")
    tree["run_dir"] = str(tmp_path / "reuser")
    tree["data"]["from_run"] = str(from_run)
    tree["head"].update(head)
    tree["train"].update(max_steps=3, eval_every=3, save_every=3)
    path = tmp_path / "reuser.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_run_trains_on_another_runs_data_without_writing_there(source, tmp_path, capsys):
    origin = Path(source.run_dir)
    before = _tree_digest(origin / "prepared") + _tree_digest(origin / "cache")
    recipe = _reuser(source, tmp_path, origin, algorithm="peagle", num_layers=1)
    assert main(["prepare", "--no-progress", "-r", str(recipe)]) == 0
    assert main(["capture", "--no-progress", "-r", str(recipe)]) == 0
    assert "nothing to capture" in capsys.readouterr().out
    assert main(["train", "--no-progress", "-r", str(recipe)]) == 0
    run = tmp_path / "reuser"
    assert (run / "checkpoints" / "final").is_dir()
    # nothing of the data was built again here, and the other run's data are untouched
    assert not (run / "prepared").exists() and not (run / "cache").exists()
    assert _tree_digest(origin / "prepared") + _tree_digest(origin / "cache") == before


def test_missing_data_of_the_other_run_is_named(source, tmp_path, capsys):
    missing = tmp_path / "never-ran"
    recipe = _reuser(source, tmp_path, missing)
    assert main(["prepare", "--no-progress", "-r", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert f"data.from_run={missing}" in err and "meta.json" in err
    assert main(["capture", "--no-progress", "-r", str(recipe)]) != 0
    assert f"data.from_run={missing}" in capsys.readouterr().err
    assert not missing.exists()  # nothing was made there


def test_an_incomplete_cache_of_the_other_run_is_refused(source, tmp_path, capsys):
    import shutil

    origin = tmp_path / "copy"
    shutil.copytree(Path(source.run_dir) / "prepared", origin / "prepared")
    shutil.copytree(Path(source.run_dir) / "cache", origin / "cache")
    shutil.rmtree(origin / "cache" / "eval")
    recipe = _reuser(source, tmp_path, origin)
    assert main(["capture", "--no-progress", "-r", str(recipe)]) != 0
    err = capsys.readouterr().err
    assert "no complete eval cache" in err and str(origin / "cache" / "eval") in err


def test_a_damaged_shard_of_the_other_run_is_named(source, tmp_path, capsys):
    """Before, `eyas capture` of the reusing run said the other run's cache was fine (exit 0)
    with a shard whose bytes no longer matched its checksum."""
    import shutil

    origin = tmp_path / "copy"
    shutil.copytree(Path(source.run_dir) / "prepared", origin / "prepared")
    shutil.copytree(Path(source.run_dir) / "cache", origin / "cache")
    victim = sorted((origin / "cache" / "train").glob("shard-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    recipe = _reuser(source, tmp_path, origin)
    assert main(["capture", "--no-progress", "-r", str(recipe)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"eyas capture: data.from_run={origin}: {victim}: checksum mismatch")
    assert victim.read_bytes() == bytes(data)  # nothing written there


@pytest.mark.parametrize("features", ["offline", "online"])
def test_max_samples_trains_on_the_other_runs_first_conversations(source, tmp_path, features):
    """Before, data.max_samples was silently ignored with data.from_run: a run asking for
    the samples of 12 of the other run's conversations trained on all of them."""
    from types import SimpleNamespace

    from eyas.data.cache import FeatureCache
    from eyas.data.prepare import load_prepared
    from eyas.recipe import load_recipe
    from eyas.train.feed import batch_stream, open_split

    path = _reuser(source, tmp_path, Path(source.run_dir))
    conversation = load_prepared(Path(source.run_dir) / "prepared")["train"]["conversation"]
    wanted = {row for row, c in enumerate(conversation) if c < 12}
    assert 0 < len(wanted) < len(conversation)  # the source has samples on both sides
    for max_samples, expected in ((12, wanted), (None, set(range(len(conversation))))):
        overrides = [f"data.features={features}", f"data.max_samples={max_samples or 'null'}"]
        recipe = load_recipe(str(path), overrides)
        cached = FeatureCache(recipe.paths.cache, "train")  # the head's shapes, as the cache has them
        head_cfg = SimpleNamespace(aux_layer_ids=cached.aux_layer_ids, target_hidden_size=cached.hidden_size)
        src = open_split(recipe, head_cfg, "train")
        rows = src.sample_rows() if isinstance(src, FeatureCache) else list(range(len(src)))
        stream = batch_stream(recipe, src, 0, 1)
        trained = {rows[i] for batch in stream.plan(0) for i in batch}
        assert trained == expected


def test_max_samples_below_every_conversation_of_the_other_run_is_refused(source, tmp_path):
    from eyas.data.from_run import first_conversations
    from eyas.data.prepare import load_prepared
    from eyas.recipe import load_recipe

    train = load_prepared(Path(source.run_dir) / "prepared")["train"]
    first = min(train["conversation"])
    assert first > 0  # the seeded split put the source's first conversation in eval
    recipe = load_recipe(str(_reuser(source, tmp_path, Path(source.run_dir))), [f"data.max_samples={first}"])
    with pytest.raises(ValueError, match=f"data.max_samples={first}: none of the {len(train)} train samples"):
        first_conversations(recipe, train)


def test_a_rerun_on_other_conversations_of_the_other_run_is_another_run():
    """The prepared data's digest is the other run's either way, so the subset is recorded
    itself: resuming a 650-conversation run at 1,300 would mix two runs in one head."""
    from eyas.recipe import recipe_from_dict
    from eyas.train.run_settings import changed_settings, training_settings

    def settings(**data):
        return training_settings(recipe_from_dict({"data": data}), "digest")

    half, whole = settings(from_run="a", max_samples=650), settings(from_run="a", max_samples=1300)
    assert changed_settings(half, whole) == ["data.max_samples: 650 -> 1300"]
    # a run that prepares its own data has its conversations in the digest already
    assert "data.max_samples" not in settings(max_samples=650)
