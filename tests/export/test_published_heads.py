"""Every published head layout we know of imports, and `eyas export --check` agrees with
the import on each. The configs in tests/support/fixtures/published_heads are the published
config.json files (facts; SOURCES.md says where each was read), scaled down in width
for CI; the tensors are random, with the names and shapes each producer writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from support.published_heads import (
    FIXTURES,
    VT,
    H,
    producer_tensors,
    scaled_config,
)

from eyas.cli import main
from eyas.export.head_dir import TargetFacts
from eyas.export.reader import load_any_head
from eyas.export.validate import validate_export
from eyas.export.writer import export_head

PUBLISHED = sorted(p.parent.name for p in FIXTURES.glob("*/config.json"))


def _producer(name: str) -> str:
    return (
        name.split("_", 1)[0]
        if name.split("_", 1)[0] in ("specforge", "modelopt", "eagle")
        else "speculators"
    )


def _facts(name: str) -> TargetFacts:
    facts = json.loads((FIXTURES / name / "verifier.json").read_text())
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = facts["num_hidden_layers"] or max(ids) + 1  # unknown: the least the aux ids allow
    return TargetFacts(
        num_layers=layers,
        hidden_size=H,
        vocab_size=VT,
        model_type=facts.get("model_type", "llama"),
        architectures=tuple(facts.get("architectures", ())),
        source=f"{facts['name_or_path']} (scaled)",
    )


def _write(tmp_path, name):
    raw = scaled_config(name)
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    save_file(producer_tensors(raw, _producer(name)), str(d / "model.safetensors"))
    return d, raw


@pytest.mark.skipif(not PUBLISHED, reason="no published fixtures")
@pytest.mark.parametrize("name", PUBLISHED)
def test_published_head_imports_and_check_agrees(tmp_path, name, capsys):
    d, raw = _write(tmp_path, name)
    facts = _facts(name)
    problems = validate_export(d, facts)
    assert problems == [], "\n".join(problems)
    head = load_any_head(d, target_embed=torch.zeros(VT, H), target=facts)
    cfg = head.config
    published_ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    L = facts.num_layers
    assert cfg.aux_layer_ids == (published_ids or [2, L // 2, L - 3])
    assert cfg.draft_vocab_size == raw.get("draft_vocab_size", VT) and cfg.target_num_layers == L
    # what was imported exports again into a directory both read the same way
    verifier_id = json.loads((FIXTURES / name / "verifier.json").read_text())["name_or_path"]
    again = export_head(
        head,
        tmp_path / "again",
        fmt="speculators" if "speculators_config" in raw else "eagle",
        verifier=verifier_id,
    )
    assert validate_export(again, facts) == []
    # and the command agrees (with the verifier given as a local config)
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(
        json.dumps(
            {"model_type": facts.model_type, "num_hidden_layers": L, "hidden_size": H, "vocab_size": VT}
        )
    )
    assert main(["export", "--check", str(d), "--target", str(verifier)]) == 0
    capsys.readouterr()


@pytest.mark.skipif(not PUBLISHED, reason="no published fixtures")
@pytest.mark.parametrize("name", PUBLISHED)
def test_published_head_against_a_wrong_verifier_is_refused_by_both(tmp_path, name):
    from eyas.export.validate import ExportValidationError

    d, _ = _write(tmp_path, name)
    wrong = TargetFacts(
        num_layers=_facts(name).num_layers,
        hidden_size=H,
        vocab_size=VT + 8,
        model_type="llama",
        architectures=(),
        source="a wrong verifier",
    )
    problems = validate_export(d, wrong)
    assert any("vocab_size 320 != the verifier's vocab_size 328" in p for p in problems)
    with pytest.raises(ExportValidationError) as err:
        load_any_head(d, target_embed=torch.zeros(VT, H), target=wrong)
    assert err.value.problems == problems


def test_amazon_peagle_tensor_layout_imports(tmp_path):
    """amazon's P-EAGLE checkpoints (as the Neuron examples that load them read them):
    layer 0 as `midlayer.*` beside `layers.1..3.*`, `mask_hidden` [1, 1, n·Ht], `d2t` alone."""
    from support.tiny_heads import random_head

    src = random_head(algorithm="peagle", draft_vocab_size=100, mask_token_id=3, num_hidden_layers=4)
    d = export_head(src, tmp_path / "h")
    from safetensors.torch import load_file

    tensors = load_file(str(d / "model.safetensors"))
    renamed = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
    }
    renamed["mask_hidden"] = renamed["mask_hidden"].reshape(1, 1, -1)
    renamed.pop("t2d")
    save_file(renamed, str(d / "model.safetensors"))
    assert validate_export(d) == []
    head = load_any_head(d)
    assert torch.equal(head.mask_hidden, src.mask_hidden.to(head.mask_hidden.dtype))
    assert torch.equal(
        head.layers[0].self_attn.q_proj.weight, src.layers[0].self_attn.q_proj.weight.to(torch.bfloat16)
    )
    assert torch.equal(head.t2d, src.t2d)
