"""One reading of a head directory: `eyas export --check` and import agree on pickle-only
directories, on heads that contradict their verifier, on vLLM's defaults for fields a
published config leaves out, and on heads named by a Hub id (DESIGN §5.1)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.fake_hub_files import FakeHubFiles
from support.tiny_heads import HT, VT, random_head, verifier_dir

from eyas.cli import main
from eyas.export.head_dir import TargetFacts
from eyas.export.reader import load_any_head
from eyas.export.validate import ExportValidationError, inspect_export, validate_export
from eyas.export.writer import ExportFormatError, export_head

EMBED = torch.zeros(VT, HT)


def _facts(**kw):
    base = dict(
        num_layers=8,
        hidden_size=HT,
        vocab_size=VT,
        model_type="llama",
        architectures=("LlamaForCausalLM",),
        source="the verifier",
    )
    return TargetFacts(**{**base, **kw})


def _edit(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def test_a_pickle_only_directory_is_refused_by_check_and_import_with_the_conversion(tmp_path, capsys):
    d = export_head(random_head(draft_vocab_size=100), tmp_path / "h")
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    problems = validate_export(d)
    assert len(problems) == 1 and "pytorch_model.bin" in problems[0] and "weights_only=True" in problems[0]
    with pytest.raises(ExportValidationError) as err:
        load_any_head(d, target_embed=EMBED)
    assert err.value.problems == problems
    assert main(["export", "--check", str(d)]) == 1
    assert "pickle" in capsys.readouterr().err
    # the printed conversion works, and then both accept the directory
    tensors = torch.load(d / "pytorch_model.bin", weights_only=True)
    save_file(tensors, str(d / "model.safetensors"))
    assert validate_export(d) == []
    load_any_head(d, target_embed=EMBED)


def test_sharded_safetensors_with_an_index_are_read(tmp_path):
    d = export_head(random_head(draft_vocab_size=100), tmp_path / "h")
    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors").unlink()
    weight_map = {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert validate_export(d) == []
    head = load_any_head(d, target_embed=EMBED)
    assert torch.equal(head.fc.weight, tensors["fc.weight"])
    (d / "model-00002-of-00002.safetensors").unlink()
    assert "names shards that are missing" in validate_export(d)[0]


def test_a_head_that_contradicts_its_verifier_is_refused_by_both(tmp_path):
    d = export_head(random_head(draft_vocab_size=100), tmp_path / "h")
    assert validate_export(d, _facts()) == []
    wrong = _facts(num_layers=6, hidden_size=96, vocab_size=400)
    problems = validate_export(d, wrong)
    text = "\n".join(problems)
    assert "built for a 8-layer target; the verifier has 6 layers" in text
    assert "target_hidden_size 64 != the verifier's hidden_size 96" in text
    assert "vocab_size 320 != the verifier's vocab_size 400" in text
    assert "fall outside the target's 6 layers" in text
    with pytest.raises(ExportValidationError) as err:
        load_any_head(d, target_embed=EMBED, target=wrong)
    assert err.value.problems == problems


def test_the_verifier_config_on_this_machine_is_used_without_being_passed(tmp_path):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": HT, "vocab_size": VT + 1})
    )
    d = export_head(random_head(draft_vocab_size=100, verifier_name_or_path=str(verifier)), tmp_path / "h")
    assert any(f"vocab_size {VT} != the verifier's vocab_size {VT + 1}" in p for p in validate_export(d))


def test_absent_aux_ids_take_vllms_default_for_the_verifier_with_a_note(tmp_path):
    d = export_head(
        random_head(draft_vocab_size=100, aux_layer_ids=[2, 6, 9], target_num_layers=12), tmp_path / "h"
    )
    _edit(d, lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"), c.pop("eyas")))
    hd, _ = inspect_export(d)
    assert any("not at hand" in p for p in hd.problems)  # no verifier facts: the layers are unknown
    hd, _ = inspect_export(d, _facts(num_layers=12))
    assert hd.problems == []
    assert any("[2, 6, 9], vLLM's default" in n for n in hd.notes)
    head = load_any_head(d, target_embed=EMBED, target=_facts(num_layers=12))
    assert head.config.aux_layer_ids == [2, 6, 9] and head.config.target_num_layers == 12


def test_eagle3_without_norm_before_residual_reads_vllms_default(tmp_path):
    d = export_head(random_head(draft_vocab_size=100, norm_before_residual=True), tmp_path / "h")
    _edit(d, lambda c: c.pop("norm_before_residual"))
    hd, _ = inspect_export(d)
    assert hd.problems == [] and any("norm_before_residual absent: False" in n for n in hd.notes)
    assert load_any_head(d, target_embed=EMBED).config.norm_before_residual is False


def test_a_t2d_left_out_is_derived_from_d2t(tmp_path):
    src = random_head(draft_vocab_size=100)
    d = export_head(src, tmp_path / "h")
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("t2d")
    save_file(tensors, str(d / "model.safetensors"))
    assert validate_export(d) == []
    assert torch.equal(load_any_head(d, target_embed=EMBED).t2d, src.t2d)


@pytest.fixture
def files_hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    hub = FakeHubFiles()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield hub
    hub.close()


def test_a_head_named_by_hub_id_is_downloaded_checked_and_imported(files_hub, tmp_path, capsys):
    from eyas.export.fetch import fetch_head
    from eyas.export.reader import load_any_head

    src = random_head(draft_vocab_size=100)
    d = export_head(src, tmp_path / "h")
    (d / "notes.bin").write_bytes(b"x" * 10)  # not a head file: not downloaded
    files_hub.add_dir("org/tiny-head", d)
    files_hub.add_dir("org/tiny-target", verifier_dir(tmp_path / "verifier"))  # the head's verifier
    local = fetch_head("org/tiny-head")
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    head = load_any_head(local, target_embed=EMBED)
    assert torch.equal(head.lm_head.weight, src.lm_head.weight.to(head.lm_head.weight.dtype))
    assert main(["export", "--check", "org/tiny-head"]) == 0
    assert "OK" in capsys.readouterr().out
    with pytest.raises(ExportFormatError, match="no such model repo"):
        fetch_head("org/missing")


def test_check_of_a_head_whose_verifier_cannot_be_read_says_not_checked(tmp_path, capsys):
    """The tests run offline: the verifier the head names (org/tiny-target) is neither here
    nor reachable, so --check says its shapes went unchecked and exits 1 (before: OK, 0);
    with --target it checks and passes."""
    d = export_head(random_head(draft_vocab_size=100), tmp_path / "h")
    assert main(["export", "--check", str(d)]) == 1
    out = capsys.readouterr()
    assert "OK" not in out.out
    assert f"{d}: NOT CHECKED against its verifier: org/tiny-target: " in out.err and "--target" in out.err
    assert main(["export", "--check", str(d), "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] is False and body["problems"] == [] and "org/tiny-target" in body["not_checked"]
    assert main(["export", "--check", str(d), "--target", str(verifier_dir(tmp_path / "v"))]) == 0
    assert "OK" in capsys.readouterr().out


def test_check_reads_the_verifier_config_from_the_hub_and_names_a_disagreement(files_hub, tmp_path, capsys):
    d = export_head(random_head(draft_vocab_size=100), tmp_path / "h")
    files_hub.add_dir("org/tiny-target", verifier_dir(tmp_path / "verifier", hidden_size=2 * HT))
    assert main(["export", "--check", str(d)]) == 1
    err = capsys.readouterr().err
    assert f"target_hidden_size {HT} != the verifier's hidden_size {2 * HT}" in err
    assert "org/tiny-target (config.json from the Hub)" in err
    assert any("/org/tiny-target/resolve/" in r and r.endswith("/config.json") for r in files_hub.requests)


def test_a_pickle_only_hub_repo_is_refused_by_name(files_hub, tmp_path):
    from eyas.export.fetch import fetch_head

    d = export_head(random_head(draft_vocab_size=100), tmp_path / "h")
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    files_hub.add_dir("org/pickled", d)
    with pytest.raises(ExportFormatError, match="only as a pickle"):
        fetch_head("org/pickled")
