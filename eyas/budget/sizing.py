"""A run sized to a time budget (DESIGN §2.7): measure this machine on a few batches of the
recipe's own work, estimate each stage, and choose how many conversations to read
(`data.max_samples`) and how many epochs to train (`train.epochs`) so the whole run fits.

The quickstart's recipe was chosen on one machine; on a slower one (no AMX, bf16 slower
than float32, a busy host) the same recipe can take twice as long. The probe runs the
stages' real code: one regeneration batch of median-length prompts (its replies are kept
in `prepared/regenerated.jsonl`, so `prepare` resumes after them), one target forward at
the capture's batch, a few training steps of the recipe's head at the batch the probe's
samples pack into, and plain batch-1 decoding at the eval's dtype. Estimates are linear in
the conversations read; the choice never goes above the recipe's, so a machine that fits
the recipe runs it unchanged.

The probe is eyas/budget/probe.py, what it measured and the estimates eyas/budget/rates.py;
this module chooses from them.
The choice is written to `run_dir/budget.json` and reused by a rerun (a killed run
resumes under the same settings); `report()` sets each stage's time against its estimate
and its share of the budget.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass

from eyas.budget.rates import BudgetError, Rates, estimate

log = logging.getLogger(__name__)

SIZED_KEYS = ("data.max_samples", "train.epochs")
STAGES = ("prepare", "capture", "train", "export", "eval")
MARGIN = 0.08  # of the budget, kept unallocated: the estimates are a few batches' worth
FEWEST_CONVERSATIONS = 0.25  # of the recipe's, before its epochs are cut
FEWEST_EPOCHS = 3.0  # kept while conversations go down to the probe's batch, before one epoch


def parse_duration(text: str) -> float:
    """Seconds in "30m", "1.5h", "90s", "1h30m" or a bare number of seconds."""
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", s)
    if not parts or re.sub(r"\s", "", s) != "".join(f"{n}{u}" for n, u in parts):
        raise BudgetError(f"budget {text!r}: give a duration like 30m, 1.5h, 90s or 1h30m")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if seconds <= 0:
        raise BudgetError(f"budget {text!r}: must be more than zero")
    return seconds


@dataclass
class Choice:
    max_samples: int
    epochs: float
    estimates: dict
    reasons: list

    @property
    def overrides(self) -> list[str]:
        return [f"data.max_samples={self.max_samples}", f"train.epochs={self.epochs:g}"]


def _fits(rates, recipe, left, n, e) -> bool:
    return sum(estimate(rates, recipe, n, e).values()) <= left


def _most_samples(rates, recipe, left, lo: int, hi: int, epochs: float) -> int | None:
    """The most conversations in [lo, hi] that fit at `epochs` (rounded down to a multiple of
    50 while that stays at or above `lo`); None when even `lo` does not fit."""
    if not _fits(rates, recipe, left, lo, epochs):
        return None
    low = lo
    while lo < hi:  # the estimate grows with n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(rates, recipe, left, mid, epochs) else (lo, mid - 1)
    return max(low, lo - lo % 50)


def _most_epochs(rates, recipe, left, n: int, lo: float, hi: float) -> float | None:
    """The most epochs in [lo, hi], in quarters, that fit with `n` conversations; None when
    even `lo` does not fit."""
    quarters = [q / 4 for q in range(math.ceil(lo * 4), math.floor(hi * 4) + 1)]
    fitting = [e for e in quarters if _fits(rates, recipe, left, n, e)]
    return fitting[-1] if fitting else None


def train_minutes(sized: dict, budget_s: float, spent_s: float) -> float:
    """The minutes training may take when it starts `spent_s` into the budget: what is
    left once export and eval have their estimates. A machine that slowed after the probe
    (its phase moves within minutes) then ends training early rather than the run late;
    at least a minute."""
    est = sized["estimates_s"]
    return max(1.0, (budget_s - spent_s - est["export"] - est["eval"]) / 60)


def kept_keys(recipe, fixed: tuple[str, ...]) -> tuple[str, ...]:
    """The sized keys that keep the recipe's value: those the user set, and the number of
    conversations of a run on another run's data (data.from_run: that data is what it is)."""
    return (*fixed, "data.max_samples") if recipe.data.from_run else fixed


def choose(rates: Rates, recipe, left_s: float, fixed: tuple[str, ...] = ()) -> Choice:
    """The conversations and epochs that fit `left_s` seconds: the recipe's when they fit;
    otherwise fewer conversations at the recipe's epochs, down to FEWEST_CONVERSATIONS of
    the recipe's; then fewer epochs, down to FEWEST_EPOCHS; then fewer conversations again,
    down to the probe's batch; then fewer epochs, down to one. An epoch replayed from the
    feature cache costs a fraction of regenerating its conversations, and on the same
    minutes a head trains better on fewer conversations seen three times than on twice as
    many seen once (docs/experiments.md). A key in `fixed` (set by the user) keeps the
    recipe's value."""
    n0, e0 = recipe.data.max_samples, float(recipe.train.epochs)
    fixed = kept_keys(recipe, fixed)
    if recipe.data.from_run:  # the reused data's train samples
        n0 = rates.conversations_read
    can_n, can_e = "data.max_samples" not in fixed, "train.epochs" not in fixed
    floor = max(1, min(n0, len(rates.probe_positions) or 256))
    full = sum(estimate(rates, recipe, n0, e0).values())
    reasons = [
        f"the recipe ({n0} conversations, {e0:g} epochs) is estimated at {full / 60:.1f} min; "
        f"{left_s / 60:.1f} min are left for it"
    ]
    n, e = n0, e0
    if full > left_s:
        fewest = max(floor, round(n0 * FEWEST_CONVERSATIONS)) if can_n else n0
        found = _most_samples(rates, recipe, left_s, fewest, n0, e0) if can_n else None
        if found is not None:
            n = found
            reasons.append(
                f"{n} conversations at the recipe's {e0:g} epochs fit (fewer conversations first, "
                f"down to {FEWEST_CONVERSATIONS:.0%} of the recipe's)"
            )
        else:
            n, kept_epochs = fewest, min(FEWEST_EPOCHS, e0)
            if can_e:
                e = _most_epochs(rates, recipe, left_s, n, kept_epochs, e0) or kept_epochs
            if can_n and not _fits(rates, recipe, left_s, n, e):
                n = _most_samples(rates, recipe, left_s, floor, n, e) or floor
            if can_e and not _fits(rates, recipe, left_s, n, e):
                e = _most_epochs(rates, recipe, left_s, n, min(1.0, e0), e) or min(1.0, e0)
            reasons.append(
                f"{n} conversations at {e:g} epochs (conversations down to "
                f"{FEWEST_CONVERSATIONS:.0%} of the recipe's, then epochs down to {kept_epochs:g}, "
                "then conversations down to the probe's batch, then epochs down to one)"
            )
        if not _fits(rates, recipe, left_s, n, e):
            total = sum(estimate(rates, recipe, n, e).values())
            reasons.append(
                f"the budget cannot be met: the smallest run sized here is estimated at {total / 60:.1f} min"
            )
    estimates = estimate(rates, recipe, n, e)
    reasons.append(
        f"estimated {sum(estimates.values()) / 60:.1f} min: "
        + ", ".join(f"{k} {v / 60:.1f}" for k, v in estimates.items())
    )
    return Choice(n, e, estimates, reasons)


# Other processes keeping this share of the cores busy while the probe ran mean the rates
# measured are that load's, and the run is cut for it.
BUSY_LOAD_PER_CORE = 0.5


def busy_reason(load: float | None, cores: int, path) -> str | None:
    """A reason line for budget.json when other work kept the CPU busy as the probe ran, else
    None (also where the platform cannot tell)."""
    if load is None or load < BUSY_LOAD_PER_CORE * cores:
        return None
    return (
        f"the CPU was busy as it was measured (other processes kept {load:.1f} of {cores} cores "
        f"busy): the run is sized for that load; on an idle machine delete {path} and rerun to "
        "size it again"
    )


def cpu_seconds() -> tuple[float, float] | None:
    """(seconds every core spent busy since boot, seconds this process and its waited-for
    children used), or None where /proc/stat is missing. Their growth over an interval,
    divided by it, is the load of other processes then: unlike the 1-minute load average,
    it does not still hold work that ended before (the quickstart's own pip install)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system + own.children_user + own.children_system


def other_load(before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float):
    """Cores other processes kept busy between two `cpu_seconds()` readings `wall_s` apart."""
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def size_run(
    recipe, budget_s: float, spent_s: float, fixed: tuple[str, ...] = (), progress: bool = True
) -> dict:
    """Measure, choose and write `run_dir/budget.json`; a file already there for the same
    budget is reused (a rerun resumes under the settings it started with)."""
    path = recipe.paths.budget
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise BudgetError(f"{path}: not valid JSON ({err}); delete it to size the run again") from None
        if saved.get("budget_s") == budget_s and saved.get("recipe") == recipe.name:
            log.info("using the sizing of %s (delete it to measure again)", path)
            return saved
    from eyas.budget.probe import measure

    fixed = kept_keys(recipe, fixed)
    cpu_before, start = cpu_seconds(), time.perf_counter()
    rates = measure(recipe, progress)
    probe_s = time.perf_counter() - start
    load = other_load(cpu_before, cpu_seconds(), probe_s)
    left = budget_s * (1 - MARGIN) - spent_s - probe_s
    choice = choose(rates, recipe, left, fixed)
    sized = {
        "budget_s": budget_s,
        "recipe": recipe.name,
        "spent_before_s": round(spent_s, 1),
        "probe_s": round(probe_s, 1),
        "left_s": round(left, 1),
        "recipe_values": {"data.max_samples": recipe.data.max_samples, "train.epochs": recipe.train.epochs},
        "overrides": [o for o in choice.overrides if o.split("=")[0] not in fixed],
        "estimates_s": {k: round(v, 1) for k, v in choice.estimates.items()},
        "reasons": choice.reasons + [r for r in [busy_reason(load, os.cpu_count() or 1, path)] if r],
        "other_load_during_probe": None if load is None else round(load, 2),
        "rates": asdict(rates),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sized, indent=1) + "\n")
    return sized


def report(sized: dict, took: dict[str, float]) -> str:
    """Each stage's time against its estimate and its share of the budget, as a table."""
    budget = sized["budget_s"]
    lines = [f"{'stage':<10}{'took':>10}{'estimated':>12}{'share':>8}"]
    est = dict(sized.get("estimates_s", {}))
    est.setdefault("setup", sized.get("spent_before_s"))
    est.setdefault("sizing", sized.get("probe_s"))
    for stage, seconds in took.items():
        e = est.get(stage)
        lines.append(
            f"{stage:<10}{seconds / 60:>9.1f}m{(f'{e / 60:.1f}m' if e is not None else '-'):>12}"
            f"{seconds / budget:>8.0%}"
        )
    total = sum(took.values())
    verdict = "within" if total <= budget else "OVER"
    lines.append(
        f"{'total':<10}{total / 60:>9.1f}m{'':>12}{total / budget:>8.0%}  ({verdict} the budget of "
        f"{budget / 60:.0f} min)"
    )
    return "\n".join(lines)
