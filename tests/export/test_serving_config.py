"""The serving config's one schema (`export/serving_config.py`, DESIGN §5): exports stay
byte-identical to the golden files written by the exporter before the schema existed,
import → export round-trips, and a config vLLM could not read is refused naming the field.

`python tests/export/test_serving_config.py --write-golden` rewrites tests/support/fixtures/exports; do
that only for an intended change of the serving files, and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from support.tiny_heads import HT, VT, random_head

from eyas.export.head_dir import TargetFacts, read_head_dir
from eyas.export.reader import export_config
from eyas.export.serving_build import build_eagle, build_speculators
from eyas.export.serving_config import parse_serving_config
from eyas.export.writer import export_head

GOLDEN = Path(__file__).parents[1] / "support" / "fixtures" / "exports"
WEIGHTS_SHA = "weights.json"

NARROW = dict(hidden_size=32, intermediate_size=64)  # H != Ht (Ht = 64)
WIDE = dict(hidden_size=96, intermediate_size=192)
PEAGLE = dict(algorithm="peagle", mask_token_id=3, speculative_tokens=7)
VARIANTS = {
    "plain": {},
    "vocab-2layers-narrow-norm-before-fc": dict(
        draft_vocab_size=100, num_hidden_layers=2, norm_before_fc=True, **NARROW
    ),
    "vocab-fc-norm-norm-output": dict(
        draft_vocab_size=200, fc_norm=True, norm_output=True, norm_before_residual=True
    ),
    "2layers-wide-fc-norm": dict(num_hidden_layers=2, fc_norm=True, **WIDE),
}

# case -> (head options, layout, dtype, verifier passed to the exporter)
CASES: dict[str, tuple[dict, str, torch.dtype, str | None]] = {}
for _algo, _base in (("eagle3", {}), ("peagle", PEAGLE)):
    for _fmt in ("speculators", "eagle"):
        for _variant, _opts in VARIANTS.items():
            CASES[f"{_algo}-{_fmt}-{_variant}"] = ({**_base, **_opts}, _fmt, torch.bfloat16, None)
CASES.update(
    {
        "eagle3-speculators-two-aux-qwen3-float32-verifier-arg": (
            dict(
                aux_layer_ids=[2, 5],
                target_model_type="qwen3",
                target_architectures=["Qwen3ForCausalLM"],
                norm_output=True,
            ),
            "speculators",
            torch.float32,
            "org/other-target",
        ),
        "eagle3-eagle-no-verifier-ships-embedding": (
            dict(verifier_name_or_path=None, draft_vocab_size=100, ship_embedding=True),
            "eagle",
            torch.bfloat16,
            None,
        ),
        "peagle-eagle-full-vocab-norm-output": (
            dict(PEAGLE, mask_token_id=319, norm_output=True, num_hidden_layers=3),
            "eagle",
            torch.bfloat16,
            None,
        ),
    }
)


def case_head(name: str):
    opts = dict(CASES[name][0])
    ship_embedding = opts.pop("ship_embedding", False)
    head = random_head(seed=sum(map(ord, name)), **opts)
    head.embedding_in_export = ship_embedding  # as an imported head that shipped its embedding
    return head


def export_case(name: str, out_dir: Path) -> Path:
    _, fmt, dtype, verifier = CASES[name]
    return export_head(case_head(name), out_dir, fmt=fmt, dtype=dtype, verifier=verifier)


def weights_sha256(path: Path) -> str:
    """sha256 of a safetensors file in a canonical form: its header JSON with sorted keys,
    then the data bytes. The file's own bytes are not reproducible: safetensors writes the
    `__metadata__` entries in a per-process hash order."""
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.dumps(json.loads(blob[8 : 8 + n]), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(header.encode() + blob[8 + n :]).hexdigest()


def write_golden() -> None:
    for name in CASES:
        out = export_case(name, GOLDEN / name)
        weights = out / "model.safetensors"
        sums = {
            "model.safetensors": {
                "canonical_sha256": weights_sha256(weights),
                "bytes": weights.stat().st_size,
            }
        }
        (out / WEIGHTS_SHA).write_text(json.dumps(sums, indent=2) + "\n")
        weights.unlink()  # only its hash is kept
        print(name)


if __name__ == "__main__" and "--write-golden" in sys.argv:
    write_golden()


def golden_config(name: str) -> str:
    return (GOLDEN / name / "config.json").read_text()


def test_every_golden_case_is_exported_by_the_test():
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_is_byte_identical_to_the_golden_files(tmp_path, name):
    out = export_case(name, tmp_path / name)
    assert (out / "config.json").read_text() == golden_config(name)
    want = json.loads((GOLDEN / name / WEIGHTS_SHA).read_text())["model.safetensors"]
    assert weights_sha256(out / "model.safetensors") == want["canonical_sha256"]
    assert (out / "model.safetensors").stat().st_size == want["bytes"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_then_export_round_trips(tmp_path, name):
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(golden_config(name))
    cfg = export_config(d)  # the config alone: no tensors read
    _, fmt, _, verifier = CASES[name]
    want = case_head(name).config
    if verifier:
        want = want.model_copy(update={"verifier_name_or_path": verifier})
    assert cfg == want
    raw = json.loads(golden_config(name))
    build = build_speculators if fmt == "speculators" else build_eagle
    again = build(cfg, ships_embedding=raw["eyas"]["embedding_included"]).to_dict()
    assert json.dumps(again, indent=2) + "\n" == golden_config(name)


def _speculators_raw() -> dict:
    return json.loads(golden_config("eagle3-speculators-plain"))


def test_bad_types_are_refused_naming_every_field_path():
    raw = _speculators_raw()
    raw["transformer_layer_config"]["hidden_size"] = "64"
    raw["transformer_layer_config"].pop("vocab_size")
    raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 0
    raw["eagle_aux_hidden_state_layer_ids"] = [1, "4", 6]
    raw["norm_before_residual"] = "no"
    raw["speculators_model_type"] = "medusa"
    parsed = parse_serving_config(raw, "speculators")
    assert parsed.problems == [
        "speculators_model_type is 'medusa', expected 'eagle3' or 'peagle'",
        "transformer_layer_config.hidden_size is '64'; input should be a valid integer",
        "transformer_layer_config.vocab_size is missing",
        "norm_before_residual is 'no', expected true or false",
        "eagle_aux_hidden_state_layer_ids is [1, '4', 6], expected a non-empty list of integers",
        "speculators_config.proposal_methods[0].speculative_tokens is 0, expected K >= 1",
    ]
    # the values that did validate are still read
    assert parsed.config.transformer_layer_config.num_attention_heads == 4
    assert parsed.config.transformer_layer_config.hidden_size is None
    assert parsed.config.speculators_config.verifier.name_or_path == "org/tiny-target"


def test_a_refused_value_is_not_taken_as_absent(tmp_path):
    raw = _speculators_raw()
    raw["draft_vocab_size"] = None  # absent means vocab_size; null is refused
    raw["norm_before_residual"] = 1  # absent means False for EAGLE-3; 1 is refused
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    hd = read_head_dir(d)
    assert hd.problems == [
        "draft_vocab_size is None, expected a positive integer",
        "norm_before_residual is 1, expected true or false",
    ]
    assert hd.fields["vd"] is None and hd.fields["norm_before_residual"] is None and hd.notes == []


def test_the_eagle_layout_is_refused_naming_flat_paths():
    raw = json.loads(golden_config("peagle-eagle-plain"))
    raw["num_hidden_layers"] = 1.0
    raw["eagle_config"] = []
    raw["ptd_token_id"] = "3"
    assert parse_serving_config(raw, "eagle").problems == [
        "num_hidden_layers is 1.0; input should be a valid integer",
        "eagle_config is [], expected an object",
        "ptd_token_id is '3', expected an integer",
    ]


def test_unknown_keys_pass():
    raw = _speculators_raw()
    raw.update(
        auto_map={"": "eagle3.Eagle3SpeculatorConfig"}, torch_dtype="float32", has_no_defaults_at_init=False
    )
    raw["transformer_layer_config"]["pretraining_tp"] = 1
    raw["speculators_config"]["verifier"]["revision"] = "main"
    assert parse_serving_config(raw, "speculators").problems == []


def test_a_published_style_config_takes_vllms_defaults_with_the_same_notes(tmp_path):
    raw = _speculators_raw()
    layer = raw["transformer_layer_config"]
    for key in ("num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters"):
        layer.pop(key)
    layer.pop("max_position_embeddings")
    scaling = {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    layer["rope_scaling"] = scaling
    raw.pop("norm_before_residual")
    raw.pop("eagle_aux_hidden_state_layer_ids")
    raw["target_hidden_size"] = None
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    hd = read_head_dir(d, TargetFacts(8, HT, VT, "llama", ("LlamaForCausalLM",), "the verifier"))
    assert hd.problems == []
    assert hd.notes == [
        "transformer_layer_config.absent, the llama defaults vLLM applies: num_key_value_heads=4, "
        "head_dim=16, rms_norm_eps=1e-06, max_position_embeddings=2048, rope_theta=10000.0",
        "norm_before_residual absent: False, vLLM's EAGLE-3 default",
        "eagle_aux_hidden_state_layer_ids absent: [2, 4, 5], vLLM's default (2, L//2, L-3) for the "
        "verifier's 8 layers; a head trained on other layers drafts badly",
    ]
    f = hd.fields
    assert (f["kv"], f["hd"], f["ht"], f["aux"], f["norm_before_residual"]) == (4, 16, HT, [2, 4, 5], False)
    assert (f["rms_norm_eps"], f["rope_theta"], f["max_position_embeddings"]) == (1e-6, 10000.0, 2048)
    assert f["rope_scaling"] == scaling  # the head applies it (tests/heads/test_rope_scaling.py)


def test_a_speculators_config_needs_a_verifier():
    cfg = random_head(verifier_name_or_path=None).config
    with pytest.raises(ValueError, match="--verifier"):
        build_speculators(cfg)
