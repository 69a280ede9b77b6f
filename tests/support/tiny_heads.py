"""The tiny draft heads the tests build, in two sizes. `tiny_head_config` (H 64, V 320, an
8-layer verifier) and `random_head` are what the export, import, validate and push tests
write and read back; `small_head_config` (H 32 over a 24-wide, 4-layer target, V 50) with
`double_head_and_batch` is the float64 head and batch that the train/serve equalities
compare to 1e-9."""

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


SMALL = dict(
    hidden_size=32,
    target_hidden_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=50,
    draft_vocab_size=50,
    aux_layer_ids=[1, 2, 3],
    target_num_layers=4,
    rms_norm_eps=1e-6,
)


def small_head_config(**overrides) -> DraftHeadConfig:
    return DraftHeadConfig(**{**SMALL, **overrides})


def random_batch(cfg: DraftHeadConfig, b: int, t: int, lengths=None, left: bool = False) -> dict:
    """b rows of t random tokens (never a P-EAGLE head's mask token) and float64 aux states;
    `lengths` real slots per row, the rest padding (on the left with `left`)."""
    high = cfg.vocab_size if cfg.mask_token_id is None else cfg.mask_token_id
    ids = torch.randint(0, high, (b, t))
    am = torch.ones(b, t, dtype=torch.long)
    for row, n in enumerate(lengths or ()):
        if left:
            am[row, : t - n] = 0
        else:
            am[row, n:] = 0
    aux = torch.randn(b, t, cfg.fc_in_features, dtype=torch.double)
    return {"input_ids": ids, "attention_mask": am, "aux": aux}


def double_head_and_batch(seed: int, b: int, t: int, lengths=None, left: bool = False, **overrides):
    """A float64 `small_head_config` head (of the algorithm `overrides` name) and a
    `random_batch` for it, both drawn after seeding torch with `seed`."""
    torch.manual_seed(seed)
    head = build_head(small_head_config(**overrides)).double()
    return head, random_batch(head.config, b, t, lengths, left)
