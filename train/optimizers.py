"""The optimizer of a training run (`train.optimizer`, DESIGN §2.4): AdamW over every
trainable parameter, or Muon (torch.optim.Muon) over the head's 2-D hidden weight matrices
with AdamW over the rest (embeddings, the LM head, norms, the P-EAGLE mask parameters).

Muon orthogonalises each matrix's update as a whole (Newton-Schulz iterations), so it
needs every matrix whole on the rank that steps it: under FSDP2 a rank holds row shards
(DTensors) and DeepSpeed builds and shards its own optimizer, so both are refused.

torch.optim.Muon always iterates in bf16, which a CPU without bf16 instructions (an AVX2
EPYC) multiplies tens of times slower than float32. `Muon` below is torch's algorithm
with the iteration in the run's compute dtype (DESIGN §2.4).
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


# The quintic Newton-Schulz coefficients published with Muon (and torch's defaults): five
# iterations take every singular value of a unit-norm matrix to roughly [0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalised(
    update: torch.Tensor, steps: int, dtype: torch.dtype, coefficients=NS_COEFFICIENTS, eps=1e-7
) -> torch.Tensor:
    """`update` [m, n] with its singular values pushed towards 1 by `steps` Newton-Schulz
    iterations computed in `dtype` (on the short side's Gram matrix)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _closure_loss(closure):
    """The loss a `step(closure)` returns: the closure's, evaluated with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# torch < 2.9 has no Muon: the module still imports there, and build_optimizer refuses
# `train.optimizer: muon` with the reason.
class Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch.optim.Muon (its param groups, defaults and state dict, so a checkpoint of either
    loads into the other) with the Newton-Schulz iteration in `ns_dtype`."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        if self.defaults["adjust_lr_fn"] not in (None, "original"):
            raise ValueError(f"Muon: adjust_lr_fn {self.defaults['adjust_lr_fn']!r} is not supported here")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalised(
                    update, group["ns_steps"], self.ns_dtype, group["ns_coefficients"], group["eps"]
                )
                rows, cols = p.shape
                p.mul_(1 - lr * group["weight_decay"])
                # a tall matrix's update is scaled up as torch's "original" adjustment does
                p.add_(update.to(p.dtype), alpha=-lr * max(1.0, rows / cols) ** 0.5)
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for `muon_params`, AdamW for `adamw_params`, stepped together. Its param_groups
    are the two optimizers' own (Muon's first), so a learning-rate schedule scales each
    from its own base rate; its state dict holds both states under "muon" and "adamw"."""

    def __init__(self, muon_params, adamw_params, *, muon_lr, lr, betas, weight_decay, ns_dtype):
        self.muon = Muon(muon_params, lr=muon_lr, weight_decay=weight_decay, ns_dtype=ns_dtype)
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__([*muon_params, *adamw_params], {})
        # the groups the base class made are replaced by the children's, which step
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
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


def build_optimizer(
    named_params: Iterable[tuple[str, torch.Tensor]], cfg, mixed_precision: str
) -> torch.optim.Optimizer:
    """The optimizer `cfg` (the recipe's TrainSection) asks for over the trainable ones of
    `named_params`. `mixed_precision` (accelerate's name, as resolved for the run): Muon
    iterates in bf16 where the run computes in bf16 or fp16, in float32 otherwise."""
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
    ns_dtype = torch.float32 if mixed_precision == "no" else torch.bfloat16
    return MuonWithAdamW(
        muon, rest, muon_lr=cfg.muon_lr, lr=cfg.learning_rate, betas=betas, weight_decay=wd, ns_dtype=ns_dtype
    )


def refuse_muon_when_sharded(cfg, sharded_by: str | None) -> None:
    """Muon steps whole matrices (module docstring): refused under `sharded_by` ("FSDP2",
    "DeepSpeed"), with the reason."""
    if cfg.optimizer == "muon" and sharded_by:
        raise ValueError(
            f"train.optimizer: muon cannot run under {sharded_by}: Muon orthogonalises each "
            "weight matrix's update as a whole, and there every rank holds only a shard of it "
            "(DeepSpeed also builds its own optimizer). Use adamw, or a plain / DDP launch"
        )
