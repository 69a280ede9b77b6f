"""Drafting algorithms by name (DESIGN §1): each is one registered `Algorithm` that owns its
head class, its recipe section (`train.<name>`), its loss, what its export declares and
what the planner charges for its drafts. EAGLE-3 registers in `heads/eagle3.py`, P-EAGLE
in `heads/peagle.py`; a new algorithm registers the same way and no stage's code changes.

The registry lives in `heads/` because every stage imports heads and heads import no
stage: the loss is named by its import path and imported only by the trainer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class AlgorithmSection(BaseModel):
    """Base of an algorithm's `train.<name>` recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    # What `eyas preflight` calls the activations a training step holds, and how many
    # copies of one pass's activations per token they are (its memory estimate).
    ACTIVATIONS: ClassVar[str] = "head activations"

    def activation_copies(self) -> float:
        return 1


@dataclass(frozen=True)
class Algorithm:
    name: str
    head_class: type  # built as head_class(DraftHeadConfig)
    training: type[AlgorithmSection]  # the recipe's train.<name> section
    # The loss `(head, batch, labels, train_cfg, generator) -> StepStats`, or its import
    # path "module:function" (heads may not import the trainer).
    loss: str | Callable
    speculators_architecture: str  # `architectures` of its speculators config.json
    # One head pass drafts all K tokens (vLLM `parallel_drafting`); else K chained passes.
    parallel_drafting: bool = False
    # The head learns embedding rows of its own (P-EAGLE's mask token), so it ships them.
    trains_embedding: bool = False
    needs_mask_token: bool = False
    # The depth the planner assumes when none is given: that of the published heads.
    typical_num_layers: int = 1
    # How a pushed head's model card names and tags it ("": the name).
    card_title: str = ""
    card_tag: str = ""
    # The `norm_before_residual` vLLM's reader of this algorithm assumes when a config does
    # not write it; None: vLLM's readers disagree, so a config must write it.
    norm_before_residual_default: bool | None = None
    # A head in the EAGLE layout that names no algorithm is read as the one with this set
    # whose need of a mask token matches the config (EAGLE-3 without, P-EAGLE with one).
    eagle_layout_default: bool = False

    def draft_passes(self, k: int) -> int:
        """Head forward passes per speculative step of K drafted tokens (the planner's cost)."""
        return 1 if self.parallel_drafting else k

    @property
    def title(self) -> str:
        return self.card_title or self.name

    @property
    def tag(self) -> str:
        return self.card_tag or self.name

    def loss_function(self) -> Callable:
        if callable(self.loss):
            return self.loss
        module, _, attr = self.loss.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[str, Algorithm] = {}
_SHIPPED = ("eyas.heads.eagle3", "eyas.heads.peagle")


def register(algorithm: Algorithm) -> Algorithm:
    """Add an algorithm (a name registered twice is an error: two meanings of one name)."""
    known = _REGISTRY.get(algorithm.name)
    if known is not None and known != algorithm:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def algorithm_names() -> list[str]:
    _load_shipped()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name`; an unknown name is an error listing the known ones."""
    _load_shipped()
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def find_algorithm(name) -> Algorithm | None:
    """The registered algorithm `name`, or None (a head file may name one we do not know)."""
    _load_shipped()
    return _REGISTRY.get(name) if isinstance(name, str) else None


def eagle_layout_algorithm(has_mask_token: bool) -> str | None:
    """The algorithm of an EAGLE-layout head that names none (`eagle_layout_default`)."""
    _load_shipped()
    return next(
        (
            a.name
            for a in _REGISTRY.values()
            if a.eagle_layout_default and a.needs_mask_token == has_mask_token
        ),
        None,
    )


def build_head(config):
    """The head module of `config.algorithm` (a `DraftHeadConfig`), freshly initialised."""
    return get_algorithm(config.algorithm).head_class(config)


def _load_shipped() -> None:
    # Imported on first use: the head modules import this one to register themselves.
    for module in _SHIPPED:
        importlib.import_module(module)
