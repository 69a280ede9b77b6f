"""The optimizer of a training run (`train.optimizer`, DESIGN §2.4): AdamW over every
trainable parameter, or Muon (torch.optim.Muon) over the head's 2-D hidden weight matrices
with AdamW over the rest (embeddings, the LM head, norms, the P-EAGLE mask parameters).

Muon orthogonalises each matrix's update as a whole (Newton-Schulz iterations), so it
needs every matrix whole on the rank that steps it: under FSDP2 a rank holds row shards
(DTensors) and DeepSpeed builds and shards its own optimizer, so both are refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Parameter names (suffixes) that stay with AdamW though they are matrices: Muon's
# orthogonalised step suits hidden layers, not the token-indexed input and output tables.
ADAMW_MATRICES = ("embed_tokens.weight", "lm_head.weight")


def muon_parameter(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps `param`: a 2-D hidden weight matrix (attention and MLP
    projections, fc), not a table of `ADAMW_MATRICES`."""
    return param.ndim == 2 and not name.endswith(ADAMW_MATRICES)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for `muon_params`, AdamW for `adamw_params`, stepped together. Its param_groups
    are the two optimizers' own (Muon's first), so a learning-rate schedule scales each
    from its own base rate; its state dict holds both states under "muon" and "adamw"."""

    def __init__(self, muon_params, adamw_params, *, muon_lr, lr, betas, weight_decay):
        self.muon = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=weight_decay)
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__([*muon_params, *adamw_params], {})
        # the groups the base class made are replaced by the children's, which step
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                f"a Muon + AdamW state has the keys muon and adamw, this one {sorted(state_dict)[:4]}"
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def build_optimizer(named_params: Iterable[tuple[str, torch.Tensor]], cfg) -> torch.optim.Optimizer:
    """The optimizer `cfg` (the recipe's TrainSection) asks for over the trainable ones of
    `named_params`."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    betas, wd = tuple(cfg.betas), cfg.weight_decay
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=cfg.learning_rate, betas=betas, weight_decay=wd)
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(
            f"train.optimizer: muon needs torch.optim.Muon, which torch {torch.__version__} lacks; "
            "use adamw or a torch that has it"
        )
    muon = [p for n, p in named if muon_parameter(n, p)]
    rest = [p for n, p in named if not muon_parameter(n, p)]
    if not muon:
        raise ValueError("train.optimizer: muon, but the head trains no hidden weight matrix")
    return MuonWithAdamW(muon, rest, muon_lr=cfg.muon_lr, lr=cfg.learning_rate, betas=betas, weight_decay=wd)


def refuse_muon_when_sharded(cfg, sharded_by: str | None) -> None:
    """Muon steps whole matrices (module docstring): refused under `sharded_by` ("FSDP2",
    "DeepSpeed"), with the reason."""
    if cfg.optimizer == "muon" and sharded_by:
        raise ValueError(
            f"train.optimizer: muon cannot run under {sharded_by}: Muon orthogonalises each "
            "weight matrix's update as a whole, and there every rank holds only a shard of it "
            "(DeepSpeed also builds its own optimizer). Use adamw, or a plain / DDP launch"
        )
