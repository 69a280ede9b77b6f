"""Draft heads whose acceptance is known in advance, for scripts/vllm_check.py.

A *lens head* reads the input of the target's last decoder layer (aux id L-1, the last id
a head may use), passes it through untouched and ends in the target's own final norm and
`lm_head` rows: fc selects that aux chunk with an identity block, and every attention
`o_proj` and MLP `down_proj` is zero, so each decoder layer adds exactly 0 to the residual
stream. Its draft at the last verified slot p is the "logit lens" of the target's layer
L-1 state at p, a function of the target's own states that this module writes out by hand
(`reference_drafts`, no eyas head code). Replaying those drafts against the plain greedy
output (`replay_oracle`) counts, before anything is served, how many drafts vLLM and eyas
must accept at each position: random heads accept nothing, a lens head accepts a countable,
non-trivial number (the lens mostly names the token just produced, so repeats are
accepted).

Options stay checkable the same way: `fc_norm` (weights 1) normalises the chunk first,
`norm_before_residual` (hidden_norm weights 1) the residual, `norm_output` feeds the normed
state to later chain steps, a draft vocabulary keeps the target's `lm_head` rows of its ids
(d2t offsets). A P-EAGLE lens head drafts the lens at slot 0 and, at every mask slot, the
lens of the fixed state `mask_state` placed in `mask_hidden`.

`add_window_attention` turns a lens head with a `sliding_window` into one whose drafts
depend on the keys the window shows (no replay predicts those; vllm_check.py compares
it with eyas's own decoding instead).
"""

from __future__ import annotations

import torch

from eyas.heads.algorithms import build_head
from eyas.heads.config import head_config_from_target
from eyas.heads.eagle3 import Eagle3Head
from eyas.target.features import target_norm_and_lm_head
from eyas.target.load import text_config


def lens_aux_layer_ids(num_layers: int) -> list[int]:
    """Three ascending ids ending at L-1, the input of the last decoder layer."""
    return [2, num_layers // 2, num_layers - 1]


@torch.no_grad()
def build_lens_head(
    model,
    *,
    algorithm: str = "eagle3",
    draft_ids: torch.Tensor | None = None,
    fc_norm: bool = False,
    norm_output: bool = False,
    norm_before_residual: bool = False,
    num_hidden_layers: int = 1,
    sliding_window: int | None = None,
    mask_token_id: int | None = None,
    mask_state: torch.Tensor | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
    seed: int = 0,
) -> Eagle3Head:
    """A float32 lens head for the HF target `model`.

    draft_ids [Vd] ascending target ids of the draft vocabulary (None: the full vocabulary);
    mask_state [Ht]: the layer L-1 state whose lens the P-EAGLE mask slots draft.
    The attention/MLP weights that stay are random: they must not change any draft.
    """
    tc = text_config(model.config)
    ht, vt = tc.hidden_size, model.get_output_embeddings().weight.shape[0]
    vd = vt if draft_ids is None else int(draft_ids.numel())
    options = dict(
        fc_norm=fc_norm,
        norm_output=norm_output,
        norm_before_residual=norm_before_residual,
        speculative_tokens=speculative_tokens,
        sliding_window=sliding_window,
    )
    if algorithm == "peagle":
        options["mask_token_id"] = mask_token_id
    cfg = head_config_from_target(
        tc,
        aux_layer_ids=lens_aux_layer_ids(tc.num_hidden_layers),
        draft_vocab_size=vd,
        algorithm=algorithm,
        num_hidden_layers=num_hidden_layers,
        verifier_name_or_path=verifier,
        **options,
    )
    torch.manual_seed(seed)
    head = build_head(cfg).float()
    if draft_ids is not None:
        draft_ids = draft_ids.long()
        t2d = torch.zeros(vt, dtype=torch.bool)
        t2d[draft_ids] = True
        head.set_vocab_map(draft_ids - torch.arange(vd), t2d)
    norm, lm_head = target_norm_and_lm_head(model)
    head.init_from_target(
        model.get_input_embeddings().weight.float(), lm_head.weight.float(), norm.weight.float()
    )
    n = cfg.num_aux
    fc = torch.zeros(cfg.hidden_size, n * ht)
    fc[:, (n - 1) * ht :] = torch.eye(ht)
    head.fc.weight.copy_(fc)
    for layer in head.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    if algorithm == "peagle":
        if mask_state is None:
            raise ValueError("a P-EAGLE lens head needs mask_state [Ht]")
        mh = torch.zeros(1, n * ht)
        mh[0, (n - 1) * ht :] = mask_state.float()
        head.mask_hidden.copy_(mh)
    return head.eval()


@torch.no_grad()
def add_window_attention(head: Eagle3Head, embed: torch.Tensor, scale: float) -> Eagle3Head:
    """Make layer 0's attention matter, so the head's drafts depend on which keys its
    (sliding) window lets it see: q_proj zero makes the attention uniform over the visible
    keys, v_proj reads the normed token embedding of each key and keeps its component in the
    top principal directions of the target's embedding `embed` [Vt, Ht] (one block of
    head_dim per KV head), and o_proj writes `scale` times that back into the residual. The
    draft is then the lens of the target's state plus the mean embedding of the last few
    tokens: with a tied lm_head it leans towards recently seen tokens, more the smaller
    the window. Layers past 0 keep their zero o_proj."""
    attn = head.layers[0].self_attn
    h, d, n_kv = head.config.hidden_size, attn.head_dim, attn.num_kv_heads
    group = attn.num_heads // n_kv
    basis = torch.linalg.svd(embed.float(), full_matrices=False).Vh[: n_kv * d]  # [n_kv*d, Ht]
    attn.q_proj.weight.zero_()
    v = torch.zeros_like(attn.v_proj.weight)
    v[:, :h] = basis  # the embedding half of layer 0's [embed, hidden] input
    attn.v_proj.weight.copy_(v)
    o = torch.zeros_like(attn.o_proj.weight)
    for g in range(n_kv):  # query head g*group reads KV head g; the other heads add nothing
        o[:, g * group * d : (g * group + 1) * d] = scale * basis[g * d : (g + 1) * d].T
    attn.o_proj.weight.copy_(o)
    return head


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def reference_drafts(
    model,
    states: torch.Tensor,
    k: int,
    *,
    algorithm="eagle3",
    draft_ids=None,
    fc_norm=False,
    norm_output=False,
    norm_before_residual=False,
    mask_state=None,
) -> torch.Tensor:
    """The lens head's drafts written out by hand: states [N, Ht] the target's layer L-1
    inputs at N verified slots -> draft target ids [N, k]."""
    tc = text_config(model.config)
    eps = float(getattr(tc, "rms_norm_eps", 1e-6))
    norm, lm_head = target_norm_and_lm_head(model)
    w, rows = norm.weight.float(), lm_head.weight.float()
    ids = torch.arange(rows.shape[0]) if draft_ids is None else draft_ids.long()
    rows = rows[ids]

    def step(hid):  # one head pass: the layers add nothing, the residual is hid (or its norm)
        pre = _rms(hid, eps) if norm_before_residual else hid
        post = w * _rms(pre, eps)
        return ids[(post @ rows.T).argmax(-1)], (post if norm_output else pre)

    first = _rms(states.float(), eps) if fc_norm else states.float()
    tok, hid = step(first)
    out = [tok]
    if algorithm == "peagle":
        m = mask_state.float()[None]
        mask_tok, _ = step(_rms(m, eps) if fc_norm else m)
        out += [mask_tok.expand_as(tok)] * (k - 1)
    else:
        for _ in range(k - 1):
            tok, hid = step(hid)
            out.append(tok)
    return torch.stack(out, dim=-1)


def replay_oracle(tokens: list[int], guesses: torch.Tensor, k: int, max_new_tokens: int) -> dict:
    """Greedy speculative decoding replayed on a plain greedy output.

    tokens: the plain greedy output, at least max_new_tokens + k long (the verify of the
    last step sees k tokens past the end); guesses [len(tokens), k]: the drafts the head
    makes once tokens[i] is the newest token (from its slot's target states). Decoding
    stops once max_new_tokens are out, as vLLM and eyas do. Returns {"drafts": steps,
    "accepted_per_pos": [k] counts of steps whose draft position j was accepted}."""
    if len(tokens) < max_new_tokens + k:
        raise ValueError(f"the oracle needs {max_new_tokens + k} greedy tokens, got {len(tokens)}")
    per_pos, drafts, i = [0] * k, 0, 0
    while i + 1 < max_new_tokens:
        drafts += 1
        guess = guesses[i].tolist()
        n = 0
        while n < k and tokens[i + 1 + n] == guess[n]:
            n += 1
        for j in range(n):
            per_pos[j] += 1
        i += n + 1
    return {"drafts": drafts, "accepted_per_pos": per_pos}
