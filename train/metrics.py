"""Training metrics: per-step accuracy, the simulated acceptance length it implies, and the
loggers (JSONL, tensorboard, wandb — offline when no API key is set — or none).

Accuracy at TTT step k (draft argmax == target argmax, teacher-forced prefix) estimates
the conditional acceptance rate of draft position k, so
`expected_tokens_per_step([acc_0, acc_1, ...])` is the acceptance length a greedy
verifier would see (DESIGN §3, §6).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from eyas.core.acceptance import expected_tokens_per_step
from eyas.core.run_paths import RunPaths

log = logging.getLogger(__name__)


class AccuracyMeter:
    """Sums hits, counts and losses of `StepStats` over micro-batches."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.hits: list[int] = []
        self.counts: list[int] = []
        self.loss_sum = 0.0
        self.batches = 0
        self.tokens = 0
        self.extra_sums: dict[str, float] = {}

    def add(self, stats) -> None:
        if len(self.hits) < len(stats.hits):
            grow = len(stats.hits) - len(self.hits)
            self.hits += [0] * grow
            self.counts += [0] * grow
        for k, (h, c) in enumerate(zip(stats.hits, stats.counts)):
            self.hits[k] += int(h)
            self.counts[k] += int(c)
        self.loss_sum += float(stats.loss.detach()) if hasattr(stats.loss, "detach") else float(stats.loss)
        self.batches += 1
        self.tokens += int(stats.tokens)
        for name, value in getattr(stats, "extra_losses", {}).items():
            self.extra_sums[name] = self.extra_sums.get(name, 0.0) + float(value)

    def merge_counts(self, hits: list[int], counts: list[int]) -> None:
        """Replace the counts (e.g. by their sum over ranks)."""
        self.hits, self.counts = list(hits), list(counts)

    def accuracies(self) -> list[float]:
        return [h / c if c else 0.0 for h, c in zip(self.hits, self.counts)]

    def summary(self, prefix: str = "") -> dict[str, float]:
        accs = self.accuracies()
        out = {f"{prefix}loss": self.loss_sum / max(1, self.batches)}
        out.update({f"{prefix}{name}": v / max(1, self.batches) for name, v in self.extra_sums.items()})
        out.update({f"{prefix}acc_{k}": a for k, a in enumerate(accs)})
        out[f"{prefix}accept_len"] = expected_tokens_per_step(accs)
        return out


class Logger:
    """Writes a dict of scalars per step. Subclasses: JSONL, tensorboard, wandb."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger(Logger):
    def __init__(self, path: Path, resume_step: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and path.is_file():
            # steps a killed run logged after its last checkpoint are trained again: drop them
            kept = [
                line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= resume_step
            ]
            path.write_text("".join(kept))
        self.f = open(path, "a", buffering=1)

    def log(self, metrics: dict, step: int) -> None:
        self.f.write(json.dumps({"step": step, **{k: _plain(v) for k, v in metrics.items()}}) + "\n")

    def close(self) -> None:
        self.f.close()


class TensorboardLogger(Logger):
    def __init__(self, log_dir: Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # one directory is one tensorboard run; purge_step hides what a killed run logged
        # after the checkpoint it resumes from
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(log_dir), purge_step=purge)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger(Logger):
    """wandb; offline (files under run_dir/wandb, `wandb sync` later) when no API key. The
    run id is kept in the checkpoints (`TrainerState.logger_run_id`), so a resumed training
    continues the same wandb run."""

    def __init__(self, run_dir: Path, name: str, config: dict, run_id: str | None = None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "eyas"),
            name=name,
            id=run_id,
            dir=str(run_dir),
            config=config,
            mode=mode,
            resume="allow",
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({k: _plain(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def _plain(v):
    return float(v) if hasattr(v, "item") else v


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0  # a torn last line of a killed run: kept only if it parses


def make_logger(
    kind: str,
    run_dir: str | Path,
    name: str = "run",
    config: dict | None = None,
    resume_step: int | None = None,
    run_id: str | None = None,
) -> Logger:
    """The logger of `train.logger`: 'jsonl' (run_dir/metrics.jsonl), 'tensorboard'
    (run_dir/tensorboard), 'wandb', or 'none'. `resume_step`: the checkpoint step a resumed
    run continues from (what was logged after it is dropped); `run_id`: the wandb run."""
    run_dir = Path(run_dir)
    if kind == "jsonl":
        return JsonlLogger(run_dir / RunPaths.METRICS, resume_step)
    if kind == "tensorboard":
        return TensorboardLogger(run_dir / "tensorboard", resume_step)
    if kind == "wandb":
        return WandbLogger(run_dir, name, config or {}, run_id)
    if kind == "none":
        return Logger()
    raise ValueError(f"unknown train.logger {kind!r}: jsonl, tensorboard, wandb or none")
