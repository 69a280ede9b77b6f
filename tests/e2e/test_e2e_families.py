"""Per target family (Llama, Qwen3-MoE, GPT-OSS) and algorithm: target features → a few
training steps → `eyas export` → validate → load back → the same drafts."""

import json

import pytest
import torch

from eyas.cli import main
from eyas.export.reader import load_any_head
from eyas.export.validate import validate_export
from eyas.heads.algorithms import get_algorithm
from eyas.heads.config import head_config_from_target
from eyas.heads.io import save_head
from eyas.recipe import TrainSection
from eyas.target.features import compute_features, default_aux_layer_ids, target_norm_and_lm_head
from eyas.target.load import load_target, text_config
from eyas.train.build import build_trainable_head
from eyas.train.losses import target_labels

TRAIN_CFG = TrainSection(
    compile_loss="off",
    eagle3={"ttt_steps": 3, "ttt_decay": 0.8},
    peagle={"num_depths": 4, "cod_r": 0.8, "cod_r_min": 0.2, "segment_length": None},
)


def _batch(target, seed=0, b=2, t=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 300, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, -5:] = 0
    aux_ids = list(default_aux_layer_ids(target.num_layers))
    aux, last = compute_features(target.model, ids, am, aux_ids)
    return {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": am.clone(),
        "aux": aux.float(),
        "last": last.float(),
    }


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_train_export_validate_load_draft(tiny_target_dir, algorithm, tmp_path):
    try:
        loss_fn = get_algorithm(algorithm).loss_function()
    except NotImplementedError as err:
        pytest.skip(str(err))
    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")
    cfg_t = text_config(target.config)
    extra = dict(num_hidden_layers=2, mask_token_id=3) if algorithm == "peagle" else dict(fc_norm=True)
    cfg = head_config_from_target(
        cfg_t,
        aux_layer_ids=list(default_aux_layer_ids(cfg_t.num_hidden_layers)),
        draft_vocab_size=200,
        algorithm=algorithm,
        speculative_tokens=4,
        verifier_name_or_path="org/tiny-target",
        **extra,
    )
    batch = _batch(target)
    freqs = torch.bincount(batch["input_ids"].flatten(), minlength=cfg.vocab_size)
    head = build_trainable_head(cfg, target.model, freqs)
    norm, lm_head = target_norm_and_lm_head(target.model)
    labels = target_labels(
        batch["last"],
        norm,
        lm_head.weight,
        head.draft_token_ids(),
        head.t2d,
        batch["loss_mask"],
        batch["attention_mask"],
    )
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        stats = loss_fn(head, batch, labels, TRAIN_CFG, gen)
        opt.zero_grad()
        stats.loss.backward()
        opt.step()
        losses.append(float(stats.loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]

    head.eval()
    ckpt = save_head(head, tmp_path / "run" / "checkpoints" / "final")
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--dtype", "float32", "--json"]) == 0
    assert validate_export(out) == []
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == algorithm
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layer_ids(cfg_t.num_hidden_layers))

    embed = target.model.get_input_embeddings().weight.detach()
    back = load_any_head(out, target_embed=embed)
    ids, aux = batch["input_ids"][:1, :10], batch["aux"][:1, :10]
    pos = torch.arange(10)[None]
    want = head.draft(head.new_cache(), ids, aux, pos, k=4)
    got = back.draft(back.new_cache(), ids, aux, pos, k=4)
    assert torch.equal(want[0], got[0]) and torch.allclose(want[1], got[1], atol=0, rtol=0)
    assert bool((want[0] < cfg.vocab_size).all())
