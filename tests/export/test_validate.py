"""The validator rejects each way an export can break the serving contract, naming it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.tiny_heads import random_head, verifier_dir

from eyas.cli import main
from eyas.export.reader import load_any_head
from eyas.export.validate import ExportValidationError, check_export, validate_export
from eyas.export.writer import export_head


def _export(tmp_path, **overrides):
    return export_head(random_head(**overrides), tmp_path / "head")


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    def edit(t):
        t[name] = value(t) if callable(value) else value

    return edit


EAGLE = dict(draft_vocab_size=100)
PEAGLE = dict(algorithm="peagle", draft_vocab_size=100, mask_token_id=3, num_hidden_layers=2)

# (head options, config edit or None, tensor edit or None, words the message must contain)
BROKEN = {
    "missing q_proj": (
        EAGLE,
        None,
        _drop("layers.0.self_attn.q_proj.weight"),
        ["missing tensor layers.0.self_attn.q_proj.weight"],
    ),
    "missing lm_head": (EAGLE, None, _drop("lm_head.weight"), ["missing tensor lm_head.weight"]),
    "wrong fc width": (
        EAGLE,
        None,
        _set("fc.weight", torch.zeros(64, 128, dtype=torch.bfloat16)),
        ["fc.weight has shape [64, 128]", "n·Ht = 3·64"],
    ),
    "d2t with equal vocabularies": (
        {},
        None,
        _set("d2t", torch.zeros(320, dtype=torch.int64)),
        ["unexpected tensor d2t", "equals the target"],
    ),
    "P-EAGLE without mask_hidden": (PEAGLE, None, _drop("mask_hidden"), ["missing tensor mask_hidden"]),
    "P-EAGLE without embedding": (
        PEAGLE,
        None,
        _drop("embed_tokens.weight"),
        ["missing tensor embed_tokens.weight"],
    ),
    "unsorted aux ids": (
        EAGLE,
        lambda c: c.update(eagle_aux_hidden_state_layer_ids=[4, 1, 6]),
        None,
        ["not strictly ascending"],
    ),
    "aux id out of range": (
        EAGLE,
        lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 4, 8]),
        None,
        ["outside the target's 8 layers"],
    ),
    "mask id outside vocab": (
        PEAGLE,
        lambda c: c.update(mask_token_id=320, ptd_token_id=320),
        None,
        ["mask_token_id 320 lies outside the vocabulary"],
    ),
    "wrong d2t dtype": (
        EAGLE,
        None,
        _set("d2t", lambda t: t["d2t"].to(torch.int32)),
        ["d2t has dtype torch.int32"],
    ),
    "wrong weight dtype": (
        EAGLE,
        None,
        _set("norm.weight", lambda t: t["norm.weight"].to(torch.int8)),
        ["norm.weight has dtype torch.int8"],
    ),
    "mixed float dtypes": (
        EAGLE,
        None,
        _set("norm.weight", lambda t: t["norm.weight"].float()),
        ["mix dtypes"],
    ),
    "d2t out of target vocab": (
        EAGLE,
        None,
        _set("d2t", lambda t: t["d2t"] + 400),
        ["outside the target vocabulary"],
    ),
    "t2d count": (
        EAGLE,
        None,
        _set("t2d", lambda t: torch.ones(320, dtype=torch.bool)),
        ["t2d marks 320 target ids, expected draft_vocab_size 100"],
    ),
    "t2d inconsistent with d2t": (
        EAGLE,
        None,
        _set("t2d", lambda t: t["t2d"].roll(1)),
        ["t2d disagrees with d2t"],
    ),
    "lm_head rows != draft_vocab_size": (
        EAGLE,
        lambda c: c.update(draft_vocab_size=101),
        None,
        ["lm_head.weight has shape [100, 64]", "draft_vocab_size 101"],
    ),
    "model. prefix": (
        EAGLE,
        None,
        lambda t: t.update({"model.norm.weight": t.pop("norm.weight")}),
        ["'model.' prefix", "missing tensor norm.weight"],
    ),
    "extra tensor": (
        EAGLE,
        None,
        _set("rotary_emb.inv_freq", torch.zeros(8, dtype=torch.bfloat16)),
        ["unexpected tensor rotary_emb.inv_freq"],
    ),
    "missing layer": (
        PEAGLE,
        lambda c: c["transformer_layer_config"].update(num_hidden_layers=3),
        None,
        ["missing every tensor of layers.2"],
    ),
    "extra layer": (
        PEAGLE,
        lambda c: c["transformer_layer_config"].update(num_hidden_layers=1),
        None,
        ["unexpected tensor layers.1.", "num_hidden_layers = 1"],
    ),
    "non-finite values": (
        EAGLE,
        None,
        _set("fc.weight", lambda t: t["fc.weight"].index_fill(0, torch.tensor([0]), float("nan"))),
        ["fc.weight has 192 non-finite value(s)"],
    ),
    "top-level model_type": (EAGLE, lambda c: c.update(model_type="llama"), None, ["top-level model_type"]),
    "no speculative_tokens": (
        EAGLE,
        lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
        None,
        ["speculative_tokens"],
    ),
    "no verifier": (
        EAGLE,
        lambda c: c["speculators_config"]["verifier"].pop("name_or_path"),
        None,
        ["verifier.name_or_path is missing"],
    ),
    # vLLM's EAGLE-3 reader defaults it to False (a note); its P-EAGLE reader does not
    "P-EAGLE without norm_before_residual": (
        PEAGLE,
        lambda c: c.pop("norm_before_residual"),
        None,
        ["norm_before_residual"],
    ),
    "aux ids absent, target unknown": (
        EAGLE,
        lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"), c["eyas"].pop("target_num_layers")),
        None,
        ["eagle_aux_hidden_state_layer_ids absent", "not at hand"],
    ),
    "fc_norm and norm_before_fc": (
        dict(EAGLE, fc_norm=True),
        lambda c: c.update(norm_before_fc=True),
        None,
        ["exclude each other", "missing tensor input_norm.weight"],
    ),
    "two aux ids without num_aux_hidden_states": (
        dict(aux_layer_ids=[2, 5]),
        lambda c: c["transformer_layer_config"].pop("num_aux_hidden_states"),
        None,
        ["num_aux_hidden_states is missing"],
    ),
    "ptd_token_id disagrees": (
        PEAGLE,
        lambda c: c.update(ptd_token_id=4),
        None,
        ["ptd_token_id 4 != mask_token_id 3"],
    ),
    "vocab_size missing": (
        EAGLE,
        lambda c: c["transformer_layer_config"].pop("vocab_size"),
        None,
        ["transformer_layer_config.vocab_size is missing"],
    ),
}


def test_a_fresh_export_is_valid(tmp_path):
    for i, opts in enumerate((EAGLE, PEAGLE, {})):
        assert validate_export(export_head(random_head(**opts), tmp_path / str(i))) == []


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_export_is_rejected_by_name(tmp_path, case):
    opts, cfg_edit, tensor_edit, words = BROKEN[case]
    d = _export(tmp_path, **opts)
    if cfg_edit:
        _edit_config(d, cfg_edit)
    if tensor_edit:
        _edit_tensors(d, tensor_edit)
    problems = validate_export(d)
    text = "\n".join(problems)
    for w in words:
        assert w in text, f"{case}: {w!r} not in\n{text}"
    with pytest.raises(ExportValidationError):
        check_export(d)
    with pytest.raises(ExportValidationError) as err:  # import reads the directory the same way
        load_any_head(d, target_embed=torch.zeros(320, 64))
    assert err.value.problems == problems


def test_every_problem_is_listed_not_only_the_first(tmp_path):
    d = _export(tmp_path, **PEAGLE)
    _edit_tensors(d, lambda t: (t.pop("mask_hidden"), t.pop("lm_head.weight"), t.update(d2t=t["d2t"].int())))
    _edit_config(d, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[6, 4, 1]))
    text = "\n".join(validate_export(d))
    for w in ("mask_hidden", "lm_head.weight", "d2t has dtype", "not strictly ascending"):
        assert w in text


def test_eagle_layout_is_validated_too(tmp_path):
    d = export_head(random_head(**EAGLE), tmp_path / "e", fmt="eagle")
    assert validate_export(d) == []
    _edit_tensors(d, _drop("midlayer.hidden_norm.weight"))
    assert any("layers.0.hidden_norm.weight" in p for p in validate_export(d))


def test_missing_files_are_named(tmp_path):
    assert "config.json is missing" in validate_export(tmp_path)[0]
    d = _export(tmp_path, **EAGLE)
    (d / "model.safetensors").unlink()
    assert any("model.safetensors is missing" in p for p in validate_export(d))


def test_cli_check_exits_non_zero_and_lists_problems(tmp_path, capsys):
    d = _export(tmp_path, **EAGLE)
    verifier = str(verifier_dir(tmp_path / "verifier"))
    assert main(["export", "--check", str(d), "--target", verifier]) == 0
    _edit_tensors(d, lambda t: (t.pop("norm.weight"), t.pop("fc.weight")))
    assert main(["export", "--check", str(d), "--target", verifier]) == 1
    err = capsys.readouterr().err
    assert "missing tensor norm.weight" in err and "missing tensor fc.weight" in err
