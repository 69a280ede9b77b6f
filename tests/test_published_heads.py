"""Every published head layout we know of imports, and `eyas export --check` agrees with
the import on each. The configs in tests/fixtures/published_heads are the published
config.json files (facts; SOURCES.md says where each was read), scaled down in width
for CI; the tensors are random, with the names and shapes each producer writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas.cli import main
from eyas.export.head_dir import TargetFacts
from eyas.export.reader import load_exported_head
from eyas.export.validate import validate_export
from eyas.export.writer import export_head

FIXTURES = Path(__file__).parent / "fixtures" / "published_heads"
PUBLISHED = sorted(p.parent.name for p in FIXTURES.glob("*/config.json"))
H, HEADS, KV, HD, INTER, VT, VD = 64, 4, 2, 16, 128, 320, 100


def _scale(layer: dict) -> None:
    """Shrink a llama layer config's widths in place (layer count and options kept)."""
    layer.update(hidden_size=H, num_attention_heads=HEADS, intermediate_size=INTER, vocab_size=VT)
    for key, value in (("num_key_value_heads", KV), ("head_dim", HD)):
        if key in layer:
            layer[key] = value


def scaled_config(name: str) -> dict:
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    layer = raw.get("transformer_layer_config", raw)
    full_vocab = layer["vocab_size"]
    _scale(layer)
    if "draft_vocab_size" in raw:
        raw["draft_vocab_size"] = VT if raw["draft_vocab_size"] == full_vocab else VD
    if isinstance(raw.get("target_hidden_size"), int):
        raw["target_hidden_size"] = H
    for key in ("mask_token_id", "ptd_token_id"):
        if isinstance(raw.get(key), int):
            raw[key] = 7
    if not layer.get("head_dim"):
        layer["head_dim"] = H // HEADS  # shrinking the width must keep hidden // heads = head_dim
    return raw


def _aux_count(raw: dict) -> int:
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return len(ids) if ids else 3


def producer_tensors(raw: dict, producer: str) -> dict[str, torch.Tensor]:
    """Random tensors named as each producer saves them (speculators: `layers.0.*`;
    EAGLE / SpecForge / ModelOpt: `midlayer.*` for a one-layer head)."""
    layer = raw.get("transformer_layer_config", raw)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    n, layers = _aux_count(raw), layer["num_hidden_layers"]
    vd = raw.get("draft_vocab_size", VT)
    q, kv = HEADS * HD, layer.get("num_key_value_heads", HEADS) * HD
    out = {
        "fc.weight": rand(H, n * H),
        "norm.weight": torch.ones(H, dtype=dtype),
        "lm_head.weight": rand(vd, H),
    }
    for i in range(layers):
        p = "midlayer." if producer != "speculators" and layers == 1 else f"layers.{i}."
        width = 2 * H if i == 0 else H
        out.update(
            {
                p + "self_attn.q_proj.weight": rand(q, width),
                p + "self_attn.k_proj.weight": rand(kv, width),
                p + "self_attn.v_proj.weight": rand(kv, width),
                p + "self_attn.o_proj.weight": rand(H, q),
                p + "mlp.gate_proj.weight": rand(INTER, H),
                p + "mlp.up_proj.weight": rand(INTER, H),
                p + "mlp.down_proj.weight": rand(H, INTER),
                p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
                p + "hidden_norm.weight": torch.ones(H, dtype=dtype),
            }
        )
    if vd != VT:
        ids = torch.sort(torch.randperm(VT, generator=g)[:vd]).values
        out["d2t"] = ids - torch.arange(vd)
        if producer != "modelopt":  # ModelOpt ships d2t alone
            t2d = torch.zeros(VT, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
    if raw.get("fc_norm") or layer.get("fc_norm"):
        out.update({f"fc_norm.{i}.weight": torch.ones(H, dtype=dtype) for i in range(n)})
    if raw.get("norm_before_fc"):
        out["input_norm.weight"] = torch.ones(n * H, dtype=dtype)
    algo = raw.get("speculators_model_type")
    if algo == "peagle":
        out["mask_hidden"] = rand(1, n * H)
    if algo == "peagle" or producer == "specforge":  # SpecForge saves the (frozen) embedding too
        out["embed_tokens.weight"] = rand(VT, H)
    return out


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
    head = load_exported_head(d, target_embed=torch.zeros(VT, H), target=facts)
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
        load_exported_head(d, target_embed=torch.zeros(VT, H), target=wrong)
    assert err.value.problems == problems


def test_amazon_peagle_tensor_layout_imports(tmp_path):
    """amazon's P-EAGLE checkpoints (as the Neuron examples that load them read them):
    layer 0 as `midlayer.*` beside `layers.1..3.*`, `mask_hidden` [1, 1, n·Ht], `d2t` alone."""
    from test_export_helpers import random_head

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
    head = load_exported_head(d)
    assert torch.equal(head.mask_hidden, src.mask_hidden.to(head.mask_hidden.dtype))
    assert torch.equal(
        head.layers[0].self_attn.q_proj.weight, src.layers[0].self_attn.q_proj.weight.to(torch.bfloat16)
    )
    assert torch.equal(head.t2d, src.t2d)
