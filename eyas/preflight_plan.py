"""What preflight (DESIGN §2.9) plans, and the per-GPU overheads every stage counts: a
stage's bytes per rank against its budget, the whole plan, the error that refuses one.
eyas/preflight.py and eyas/preflight_engine.py size the stages; eyas/preflight_check.py
reports and enforces them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

GB = 1e9
# Per GPU, what the CUDA context, NCCL's buffers and the allocator's fragmentation take.
CONTEXT_BYTES = 2.0e9
FRAGMENTATION = 0.05


class PreflightError(RuntimeError):
    """A recipe that cannot fit; the message names the stage, the rank's bytes and the knob."""


@dataclass
class StagePlan:
    stage: str
    per_rank: dict[str, float]  # what a rank holds at its peak, bytes
    budget: float  # usable bytes per GPU
    seconds_per_mtok: float | None = None  # time per million tokens on the whole job
    knob: str | None = None
    notes: list[str] = field(default_factory=list)
    problem: str | None = None  # why it cannot run, besides memory

    @property
    def peak(self) -> float:
        return sum(self.per_rank.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget and self.problem is None


@dataclass
class Preflight:
    recipe: str
    gpu: str
    gpus: int
    nodes: int
    strategy: str
    attention: str
    weights: str
    stages: list[StagePlan]
    disk: dict[str, float]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def as_dict(self) -> dict:
        out = asdict(self)
        for s, d in zip(self.stages, out["stages"]):
            d.update(peak=s.peak, fits=s.fits)
        out["fits"] = self.fits
        return out
