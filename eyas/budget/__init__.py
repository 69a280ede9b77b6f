"""A run sized to a time budget (DESIGN §2.7): `rates` (what the probe measured and the
estimates per stage), `probe` (the stages' own code timed on this machine) and `sizing`
(the choice of conversations and epochs, budget.json, the report). The names a command
uses are here."""

from eyas.budget.rates import BudgetError, Rates, estimate
from eyas.budget.sizing import SIZED_KEYS, choose, parse_duration, report, size_run, train_minutes

__all__ = [
    "SIZED_KEYS",
    "BudgetError",
    "Rates",
    "choose",
    "estimate",
    "parse_duration",
    "report",
    "size_run",
    "train_minutes",
]
