"""Small random heads shared by the export / validate / push tests (no tests here)."""

from __future__ import annotations

import json

import torch

from eyas.heads.algorithms import build_head
from eyas.heads.config import DraftHeadConfig

VT, HT = 320, 64


def tiny_head_config(**overrides) -> DraftHeadConfig:
    fields = dict(
        hidden_size=HT,
        target_hidden_size=HT,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VT,
        draft_vocab_size=VT,
        aux_layer_ids=[1, 4, 6],
        target_num_layers=8,
        verifier_name_or_path="org/tiny-target",
        speculative_tokens=4,
    )
    fields.update(overrides)
    return DraftHeadConfig(**fields)


def random_head(seed: int = 0, **overrides):
    """A head with every parameter random (norm weights too, so a swapped norm shows)."""
    torch.manual_seed(seed)
    head = build_head(tiny_head_config(**overrides))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    cfg = head.config
    if cfg.uses_vocab_map:
        ids = torch.sort(
            torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[
                : cfg.draft_vocab_size
            ]
        ).values
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        head.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size), t2d)
    return head.eval()


def step_logits(head, seed: int = 1, t: int = 6) -> torch.Tensor:
    """Logits of one head step on fixed random inputs [1, t, Vd] (float32 inputs)."""
    g = torch.Generator().manual_seed(seed)
    cfg = head.config
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
    aux = torch.randn(1, t, cfg.fc_in_features, generator=g)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        hid = head.combine_aux(aux)
        logits, _ = head.forward_step(ids, hid, pos, head.new_cache())
    return logits.float()


def verifier_dir(d, **config):
    """A directory holding the config.json of a verifier that fits `random_head` (8 layers)."""
    d.mkdir(parents=True, exist_ok=True)
    fields = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=8,
        hidden_size=HT,
        vocab_size=VT,
    )
    (d / "config.json").write_text(json.dumps({**fields, **config}))
    return d
