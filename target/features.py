"""The frozen target's features for the draft head: the auxiliary hidden states of the
layers a head reads and the last hidden state, from one forward of the base model. Online
training, the offline capture and evaluation compute them here alike (DESIGN §2.2).
"""

from __future__ import annotations

import contextlib

import torch


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default auxiliary layers `(2, L//2, L-3)`; for small L, where those are
    not strictly ascending, three distinct ascending ids spread over [1, L-1]."""
    L = num_layers
    ids = (2, L // 2, L - 3)
    if 0 < ids[0] < ids[1] < ids[2] <= L - 1:
        return ids
    if L < 4:
        raise ValueError(f"a target needs at least 4 layers for 3 auxiliary layers, got {L}")
    return (1, max(2, L // 2), L - 1)


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The base (decoder-only) model under a *ForCausalLM: `.model` for Llama/Qwen/GPT-OSS."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers and final norm")
    return base


def target_norm_and_lm_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The frozen final norm and LM head: logits = lm_head(norm(last)) with `last` from
    `compute_features`."""
    return _decoder(model).norm, model.get_output_embeddings()


@torch.no_grad()
def compute_features(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layer_ids: tuple[int, ...] | list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the frozen target's base model once and return the draft head's inputs.

    input_ids [B, T], attention_mask [B, T] (1 = token; right or left padding).
    Returns `aux` [B, T, n*Ht] (the residual stream entering decoder layer i for each i in
    `aux_layer_ids`, i.e. HF `hidden_states[i]`, concatenated in the given order) and
    `last` [B, T, Ht] (the input of the final norm, before normalisation), both in the
    model's dtype. Forward pre-hooks grab them on the way; only the base model runs, so
    no vocabulary-sized logits are computed.
    """
    base = _decoder(model)
    layers = base.layers
    ids = list(aux_layer_ids)
    if any(not 0 <= i < len(layers) for i in ids):
        raise ValueError(f"aux layer ids {ids} must lie in [0, {len(layers) - 1}]")
    grabbed: dict = {}

    def grab(key):
        def hook(module, args, kwargs):
            # Decoder layers and the norm receive the hidden states first (positional in
            # HF today; by name in some versions).
            grabbed[key] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [layers[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in set(ids)]
    handles.append(base.norm.register_forward_pre_hook(grab("last"), with_kwargs=True))
    try:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[i] for i in ids], dim=-1)
    return aux, grabbed["last"]


@contextlib.contextmanager
def capture_aux(model, aux_layer_ids):
    """While active, every forward of `model` stores its aux states in the yielded dict
    under "aux" as `[B, T, n·Ht]`. Id i < L is the residual stream entering decoder layer
    i (HF hidden_states[i], as `compute_features`); id L is the last state before the final
    norm. Nothing is hooked when `aux_layer_ids` is empty."""
    ids = list(aux_layer_ids)
    grabbed: dict = {}
    if not ids:
        yield grabbed
        return
    base = _decoder(model)
    layers, norm = base.layers, base.norm
    if any(not 0 <= i <= len(layers) for i in ids):
        raise ValueError(f"aux layer ids {ids} must lie in [0, {len(layers)}]")
    states: dict = {}

    def grab(key):
        def hook(module, args, kwargs):
            states[key] = args[0] if args else kwargs["hidden_states"]
            if key == last_hooked:  # the last hooked module of the forward has run
                grabbed["aux"] = torch.cat([states[i] for i in ids], dim=-1)

        return hook

    last_hooked = max(ids)  # modules run in id order, whatever order `ids` lists them in
    modules = {i: (layers[i] if i < len(layers) else norm) for i in set(ids)}
    handles = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, m in modules.items()]
    try:
        yield grabbed
    finally:
        for h in handles:
            h.remove()
