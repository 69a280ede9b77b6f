"""Sliding-window head layers (`head.sliding_window`): the window changes what a head
computes only past it, export writes the fields vLLM's llama draft layer reads
(`layer_types` + `sliding_window`), every reader takes them back, and layouts eyas's head
cannot apply are problems naming the key. The training masks are held to their
references and to drafting in tests/train/test_ttt.py, test_peagle.py and test_cod.py."""

from __future__ import annotations

import json

import pytest
import torch
from support.tiny_heads import tiny_head_config

from eyas.export.head_dir import TargetFacts, read_head_dir
from eyas.export.reader import load_any_head
from eyas.export.writer import export_head
from eyas.heads.algorithms import build_head
from eyas.heads.config import DraftHeadConfig

FACTS = TargetFacts(8, 64, 320, "llama", ("LlamaForCausalLM",), "the verifier")


def _cfg(**kw) -> DraftHeadConfig:
    return tiny_head_config(aux_layer_ids=[1, 4, 5], verifier_name_or_path="org/target", **kw)


def test_a_window_changes_the_head_only_past_it():
    torch.manual_seed(0)
    windowed = build_head(_cfg(sliding_window=4, num_hidden_layers=2)).double().eval()
    full = build_head(_cfg(num_hidden_layers=2)).double().eval()
    full.load_state_dict(windowed.state_dict())
    ids, hid = torch.randint(0, 320, (1, 12)), torch.randn(1, 12, 64, dtype=torch.double)
    pos = torch.arange(12)[None]
    a, _ = windowed.forward_step(ids, hid, pos, windowed.new_cache())
    b, _ = full.forward_step(ids, hid, pos, full.new_cache())
    torch.testing.assert_close(a[:, :4], b[:, :4])  # the first 4 slots see everything anyway
    assert (a[:, 4:] - b[:, 4:]).abs().amax(-1).min() > 1e-6
    # token by token through the KV cache: the same logits as the one-call pass
    cache = windowed.new_cache()
    steps = [
        windowed.forward_step(ids[:, i : i + 1], hid[:, i : i + 1], pos[:, i : i + 1], cache)[0]
        for i in range(12)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), a)


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_export_writes_the_window_vllm_reads_and_import_reads_it_back(tmp_path, fmt, algorithm, capsys):
    from eyas.cli import main

    extra = dict(mask_token_id=7) if algorithm == "peagle" else {}
    head = build_head(_cfg(sliding_window=512, num_hidden_layers=2, algorithm=algorithm, **extra))
    out = export_head(head, tmp_path / "export", fmt=fmt, verifier="org/target")
    raw = json.loads((out / "config.json").read_text())
    layer = raw.get("transformer_layer_config", raw)
    assert layer["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert layer["sliding_window"] == 512
    back = load_any_head(out, target_embed=torch.zeros(320, 64), target=FACTS)
    assert back.config.sliding_window == 512
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 320})
    )
    assert main(["export", "--check", str(out), "--target", str(verifier)]) == 0
    capsys.readouterr()
    # a head without a window writes neither field (the pinned exports stay as they were)
    plain = export_head(build_head(_cfg()), tmp_path / "plain", verifier="org/target")
    plain_layer = json.loads((plain / "config.json").read_text())["transformer_layer_config"]
    assert "layer_types" not in plain_layer and "sliding_window" not in plain_layer


@pytest.mark.parametrize(
    "layer_types, window, problem, note",
    [
        (["sliding_attention", "full_attention"], 64, "applies one sliding window to every layer", None),
        (["sliding_attention", "sliding_attention"], None, "sliding_window is missing", None),
        (["sliding_attention"], 64, "layer_types has 1 entries for 2 layers", None),
        (None, 64, None, "sliding_window 64 without layer_types"),
        (["full_attention", "full_attention"], 64, None, None),
    ],
)
def test_window_layouts_the_head_cannot_apply_are_problems_naming_the_key(
    tmp_path, layer_types, window, problem, note
):
    head = build_head(_cfg(num_hidden_layers=2))
    out = export_head(head, tmp_path / "export", verifier="org/target")
    raw = json.loads((out / "config.json").read_text())
    layer = raw["transformer_layer_config"]
    layer.update(
        {k: v for k, v in (("layer_types", layer_types), ("sliding_window", window)) if v is not None}
    )
    (out / "config.json").write_text(json.dumps(raw))
    hd = read_head_dir(out, FACTS)
    where = "transformer_layer_config."
    if problem:
        assert any(p.startswith(where) and problem in p for p in hd.problems), hd.problems
    else:
        assert hd.problems == [] and hd.fields["sliding_window"] is None
    assert any(note in n for n in hd.notes) if note else not any("sliding_window" in n for n in hd.notes)


def test_the_recipe_key_reaches_the_head_and_is_a_training_setting_only_when_set(tmp_path, tiny_llama_dir):
    from support.train_run_fixtures import tiny_recipe

    from eyas.recipe import recipe_from_dict
    from eyas.target.load import load_target
    from eyas.train.build import head_config_for
    from eyas.train.run_settings import training_settings

    recipe = tiny_recipe(tmp_path / "run", tiny_llama_dir)
    tree = recipe.model_dump(mode="json", exclude_unset=True)
    windowed = recipe_from_dict({**tree, "head": {**tree["head"], "sliding_window": 128}})
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert head_config_for(windowed, target.config).sliding_window == 128
    assert head_config_for(recipe, target.config).sliding_window is None
    assert training_settings(windowed, None)["head.sliding_window"] == 128
    # unset, it is left out: a checkpoint recorded before the key existed still matches
    assert "head.sliding_window" not in training_settings(recipe, None)
