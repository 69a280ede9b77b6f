"""The layout of a run directory: where each stage writes and the names of its files.

It lives apart from the recipe (eyas/recipe.py builds one from `run_dir` and
`data.from_run`) so a stage can name a run's files without importing the recipe.
"""

from __future__ import annotations

from pathlib import Path


class RunPaths:
    """Where each stage of a run writes, all under one run directory, and the names of the
    files it writes there: the one place a run's artifact names are spelt. A stage given
    another directory (`prepare(out_dir=...)`, `eyas eval --out`) writes the same names
    into it; the formats' own files (cache manifest, checkpoint state, head config) are
    named by their modules."""

    # In the prepared directory (data/prepare.py).
    DATASET = "dataset"
    TOKEN_FREQS = "token_freqs.safetensors"
    PREPARED_META = "meta.json"
    DROP_REPORT = "drop_report.json"
    EVAL_PROMPTS = "eval_prompts.jsonl"
    REGENERATED = "regenerated.jsonl"
    ENGINE_LOG = "engine.log"
    # In the run directory.
    RECIPE = "recipe.yaml"  # the recipe the run trained with (train/run_setup.py)
    METRICS = "metrics.jsonl"  # train.logger: jsonl
    BUDGET = "budget.json"  # `eyas budget`
    # In the eval directory.
    EVAL_REPORT = "eval_report.json"
    EVAL_REPORT_MD = "eval_report.md"
    EVAL_PLOT = "eval_report.png"
    EVAL_CONTEXT_PLOT = "eval_by_context.png"
    EVAL_SEQUENCES = "eval_sequences.jsonl"  # per prompt, what resumes a killed eval
    PLAN = "plan.json"
    PLAN_PLOT = "plan.png"
    # In the bench-serve directory.
    BENCH_SERVE_REPORT = "bench_serve.json"
    BENCH_SERVE_POINTS = "points.jsonl"
    BENCH_SERVE_PLOT = "bench_serve.png"

    def __init__(self, root: Path, data_root: Path | None = None):
        self.root = root
        # the prepared data and cache: this run's own, or another run's (data.from_run)
        self.data_root = data_root or root
        self.prepared = self.data_root / "prepared"
        self.cache = self.data_root / "cache"
        self.checkpoints = root / "checkpoints"
        self.export = root / "export"
        self.eval = root / "eval"
        self.bench_serve = root / "bench_serve"
        self.recipe = root / self.RECIPE
        self.metrics = root / self.METRICS
        self.budget = root / self.BUDGET
        self.eval_report = self.eval / self.EVAL_REPORT
