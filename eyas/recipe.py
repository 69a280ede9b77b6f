"""The typed recipe: one YAML file describes a whole run (target, data, head, train,
export, eval). Unknown keys are errors that name the key and the file, because a typo
in a recipe otherwise silently trains with a default.

`load_recipe(path, overrides=["train.lr=2e-4", ...])` is the one entry point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from eyas.heads.algorithms import AlgorithmSection

# Drafted tokens per step: vLLM verifies K+1 positions per sequence; past a few dozen no
# head accepts anything, so a larger K is a typo.
MAX_K = 64
Beta = Annotated[float, Field(ge=0, lt=1)]  # an Adam moment decay
ReasoningEffort = Literal["none", "low", "medium", "high"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetSection(_Section):
    """The frozen target model."""

    name_or_path: str = "smollm2-135m"
    # The target's Hub id (ORG/NAME), written into the exported head as its verifier when
    # name_or_path is a local directory: `vllm serve` of a pushed head looks the target up by it.
    hub_id: str | None = None
    # auto: bfloat16 on GPUs, and on a CPU where it times faster than float32 (eyas/precision.py)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: str | None = None  # None: chosen per architecture
    trust_remote_code: bool = False
    revision: str | None = None
    device: str = "auto"
    # A quantized checkpoint (MXFP4 GPT-OSS, FP8) whose kernels are missing is refused;
    # true accepts it dequantized to bf16 (about 4x the experts' memory; preflight sizes it).
    dequantize: bool = False


class RegenerateSection(_Section):
    """Replace assistant turns with the target's own replies (DESIGN §2.1)."""

    enabled: bool = False
    # hf: the target decodes in eyas's process (data/decode.py). server: an
    # OpenAI-compatible chat endpoint (`vllm serve`, SGLang, ...) answers, at fleet scale
    # (data/regenerate_server.py).
    backend: Literal["hf", "server"] = "hf"
    max_new_tokens: int = Field(256, ge=1)
    # None: the target's own generation_config (its temperature and top_p where it samples,
    # greedy where it does not), so replies are drawn as served; 0 is greedy.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    # The effort each conversation is regenerated at: one value, or a mix drawn per
    # conversation with `seed` (e.g. {low: 0.4, medium: 0.4, high: 0.2}); sent as vLLM
    # takes it and rendered by the template (GPT-OSS's `Reasoning:` line, Qwen3's
    # thinking off for `none`). None: the template's default (data/reasoning.py).
    reasoning_effort: ReasoningEffort | dict[ReasoningEffort, Annotated[float, Field(gt=0)]] | None = None
    batch_size: int = Field(16, ge=1)
    seed: int = 0
    # Keep the states the target computes while regenerating (hf backend, offline
    # features) so `eyas capture` copies them instead of running the target again over the
    # same tokens (data/fed_states.py). Costs disk, as much as the cache, until the capture
    # ends, and a device-to-host copy per decode step; pays where decoding is slow next to
    # a forward, e.g. a CPU.
    keep_states: bool = False
    # server backend: base URLs of the engine's replicas (requests go to the least busy),
    # in-flight requests in all, the model name sent (None: the server's own, /v1/models)
    server_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    concurrency: int = Field(256, ge=1)
    server_model: str | None = None
    request_timeout_s: float = Field(600.0, gt=0)
    max_retries: int = Field(5, ge=0)
    # A command that starts the engine (e.g. `vllm serve MODEL --host 127.0.0.1 --port
    # 8000`): eyas runs it, waits until every URL answers, regenerates, then stops it.
    launch: str | None = None
    launch_timeout_s: float = Field(1800.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _no_inprocess_vllm(cls, data):
        if isinstance(data, dict) and data.get("backend") == "vllm":
            raise ValueError(
                "data.regenerate.backend 'vllm' (vLLM inside eyas's environment) was removed: vLLM "
                "pins its own torch and transformers. Use backend: server with `vllm serve` "
                "(data.regenerate.launch starts it for you)"
            )
        return data


class DataSection(_Section):
    """Conversations in; token ids, loss masks and (optionally) a feature cache out."""

    sources: list[str] = Field(default_factory=list)  # files, dataset dirs, `datasets` names, or aliases
    format: Literal["auto", "sharegpt", "openai"] = "auto"
    # A row with bytes that are not UTF-8: dropped (counted as bad_encoding), or kept with
    # U+FFFD in their place (counted as repaired bad_encoding_replaced).
    bad_encoding: Literal["drop", "replace"] = "drop"
    max_samples: int | None = Field(None, ge=1)
    max_length: int = Field(2048, ge=2)
    # A rendered sample longer than max_length: dropped (counted as over_length), or cut to
    # its first max_length tokens (counted as truncated_to_max_length; dropped when no
    # trained token is left).
    over_length: Literal["drop", "truncate"] = "drop"
    # Which assistant turns carry loss: all of one sample per conversation, its last, or
    # `turns`: a sample per assistant turn, rendered as the template serves that turn
    # (right for templates that rewrite history; docs/pipeline.md)
    train_on: Literal["all", "last", "turns"] = "all"
    max_turns: int | None = Field(None, ge=1)  # keep at most this many assistant turns per conversation
    # Drop a conversation that repeats an earlier one (after max_turns; with regeneration,
    # its user and system turns: the replies are the target's anyway). ShareGPT repeats
    # ~6% of its first 5,000 prompts ("continue", "hi", the same question asked twice).
    dedupe: bool = True
    eval_fraction: float = Field(0.02, ge=0, lt=1)  # 1 would leave nothing to train on
    regenerate: RegenerateSection = Field(default_factory=RegenerateSection)
    # Another run directory whose prepared data and feature cache this run reads as they
    # are (e.g. a P-EAGLE head on the EAGLE-3 quickstart's data): `eyas prepare` and
    # `eyas capture` only check that they are there; that run's recipe makes them.
    from_run: str | None = None
    features: Literal["offline", "online"] = "offline"  # capture cache, or target on the fly
    aux_layer_ids: list[NonNegativeInt] | None = None  # None: (2, L//2, L-3)
    cache_dtype: Literal["bf16", "fp8"] = "bf16"
    shard_tokens: int = Field(262_144, ge=1)
    capture_batch_tokens: int = Field(8192, ge=1)
    seed: int = 0


class HeadSection(_Section):
    """The draft head's shape and options (DESIGN §3, §4)."""

    algorithm: str = "eagle3"  # a registered algorithm (heads/algorithms.py)
    num_layers: int = Field(1, ge=1)
    draft_vocab_size: int = Field(32_000, ge=1)
    hidden_size: PositiveInt | None = None  # None: the target's
    intermediate_size: PositiveInt | None = None
    num_attention_heads: PositiveInt | None = None
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    mask_token_id: NonNegativeInt | None = None  # P-EAGLE only
    # attend to the last N positions only (sliding-window head layers, DESIGN §3); None: all
    sliding_window: PositiveInt | None = None
    speculative_tokens: int = Field(5, ge=1, le=MAX_K)  # K written into the serving config

    @field_validator("algorithm")
    @classmethod
    def _registered(cls, name: str) -> str:
        from eyas.heads.algorithms import get_algorithm

        get_algorithm(name)  # an unknown name is refused, naming the known ones
        return name

    @model_validator(mode="after")
    def _exclusive_norms(self) -> HeadSection:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("head.fc_norm and head.norm_before_fc exclude each other")
        return self


class TrainSection(_Section):
    """The training loop (DESIGN §2.4). An algorithm's own knobs live in its section,
    `train.<algorithm>` (`train.eagle3`, `train.peagle`), typed by the algorithm's
    registered schema (heads/algorithms.py); `section(name)` reads one."""

    # Extra keys are the algorithm sections; any other is refused in `_algorithm_sections`.
    model_config = ConfigDict(extra="allow")

    seed: int = 0
    # A head to start from instead of a fresh one (DESIGN §5.2): a directory or a Hub id
    # holding an eyas checkpoint, an export or a published head. Its architecture and draft
    # vocabulary are kept (recipe head fields that contradict them are refused); the
    # optimizer and the warmup start afresh. An EAGLE-3 head may start a P-EAGLE one.
    init_from: str | None = None
    init_from_revision: str | None = None
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    freeze_lm_head: bool = False  # keep the LM head rows copied from the target
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    warmup_steps: int = Field(100, ge=0)
    max_steps: int | None = Field(None, ge=1)  # None: epochs decide
    epochs: float = Field(1.0, gt=0)
    batch_tokens: int = Field(8192, ge=1)  # tokens per micro-batch (length-bucketed)
    max_batch_size: int = Field(64, ge=1)
    # Micro-batch length rounded up to a multiple of this: few distinct shapes, so kernels
    # built per shape (oneDNN on CPU, torch.compile) are reused instead of rebuilt per batch.
    pad_to_multiple_of: int = Field(32, ge=1)
    grad_accum: int = Field(1, ge=1)
    max_grad_norm: float = Field(0.5, ge=0)  # 0: no clipping
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: as target.dtype auto
    eval_every: int = Field(500, ge=0)  # 0: no held-out loss during training
    save_every: int = Field(500, ge=0)  # 0: only the final checkpoint
    keep_checkpoints: int = Field(2, ge=0)  # 0: keep every checkpoint
    log_every: int = Field(10, ge=1)
    logger: Literal["tensorboard", "wandb", "jsonl", "none"] = "jsonl"
    max_nonfinite_steps: int = Field(5, ge=0)
    num_workers: int = Field(0, ge=0)
    eval_batches: PositiveInt | None = (
        None  # cap on eval micro-batches per evaluation (None: the whole split)
    )
    resume: bool = True  # continue from the newest checkpoint in run_dir/checkpoints
    cpu_threads: PositiveInt | None = None  # torch intra-op threads on CPU (None: torch's default)
    # The soft cross-entropy kernels through torch.compile (a C++ toolchain on CPU). auto:
    # on CPU, once its rows are big enough to repay a ~10-30 s first compile; eager on a
    # compile failure. on: on any device. off: eager.
    compile_loss: Literal["auto", "on", "off"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            from eyas.heads.algorithms import algorithm_names, get_algorithm

            home = {
                key: name for name in algorithm_names() for key in get_algorithm(name).training.model_fields
            }
            moved = [f"train.{key} is now train.{home[key]}.{key}" for key in data if key in home]
            if moved:
                raise ValueError("; ".join(moved))
        return data

    @model_validator(mode="after")
    def _algorithm_sections(self) -> TrainSection:
        from eyas.heads.algorithms import algorithm_names, get_algorithm

        extra = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        unknown = [key for key in extra if key not in algorithm_names()]
        if unknown:
            raise ValueError(", ".join(f"unknown key 'train.{key}'" for key in unknown))
        for name, value in extra.items():
            if isinstance(value, AlgorithmSection):
                continue
            try:
                extra[name] = get_algorithm(name).training.model_validate(value or {})
            except ValidationError as err:
                raise ValueError("; ".join(_section_errors(err, f"train.{name}"))) from None
        return self

    def section(self, name: str):
        """The `train.<name>` section of algorithm `name` (its defaults when not written)."""
        from eyas.heads.algorithms import get_algorithm

        extra = self.__pydantic_extra__ or {}
        return extra[name] if name in extra else get_algorithm(name).training()


class ExportSection(_Section):
    format: Literal["speculators", "eagle"] = "speculators"
    repo_id: str | None = None
    private: bool = False


class EvalSection(_Section):
    workload: str = "mtbench"
    # The target's dtype while evaluating (None: target.dtype). float32 makes the lossless
    # check exact, and on CPUs batch-1 decoding is faster in float32 than in bfloat16.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    k: int = Field(5, ge=1, le=MAX_K)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0)
    max_prompts: PositiveInt | None = None
    baseline: Literal["ngram"] | None = "ngram"
    ngram_min: int = Field(5, ge=1)  # vLLM's prompt_lookup_min / _max defaults
    ngram_max: int = Field(5, ge=1)
    # False: beside a head, under greedy, the baseline is replayed over the plain greedy
    # tokens (the same tau and acceptance, none of its decode time; its tok/s is not
    # measured). True, or no head: decoded against the target, its tok/s measured.
    decode_baseline: bool = False
    seed: int = 0
    # At temperature > 0 (DESIGN §6): "vllm" drafts and accepts as vLLM does (the drafter's
    # argmax accepted with the target's probability, unless draft_sample_method is
    # "probabilistic"); "exact" samples drafts and accepts with min(1, p/q). top_k (0: off)
    # and top_p shape the target's distribution as vLLM's sampler does.
    sampler: Literal["vllm", "exact"] = "vllm"
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # Edges (tokens) of the context buckets tau is also reported in: < 2k, 2-8k, 8-32k,
    # longer by default (eval/context_buckets.py).
    context_buckets: list[PositiveInt] = Field(default_factory=lambda: [2048, 8192, 32768], min_length=1)

    @model_validator(mode="after")
    def _ngram_window(self) -> EvalSection:
        edges = self.context_buckets
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"eval.context_buckets must be strictly ascending, got {edges}")
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"eval.ngram_max ({self.ngram_max}) is below eval.ngram_min ({self.ngram_min})")
        return self


class Recipe(_Section):
    """A whole run. `run_dir` holds every artifact: prepared/, cache/, checkpoints/, export/, eval/."""

    name: str = "run"
    run_dir: str = "runs/default"
    target: TargetSection = Field(default_factory=TargetSection)
    data: DataSection = Field(default_factory=DataSection)
    head: HeadSection = Field(default_factory=HeadSection)
    train: TrainSection = Field(default_factory=TrainSection)
    export: ExportSection = Field(default_factory=ExportSection)
    eval: EvalSection = Field(default_factory=EvalSection)

    @model_validator(mode="after")
    def _algorithm_section_written(self) -> Recipe:
        extra = self.train.__pydantic_extra__
        if extra is not None and self.head.algorithm not in extra:
            # Written out, so recipe.yaml and the run's settings hold the algorithm's values.
            extra[self.head.algorithm] = self.train.section(self.head.algorithm)
        return self

    @model_validator(mode="after")
    def _room_for_a_prompt(self) -> Recipe:
        # Regeneration caps a prompt at max_length - max_new_tokens; with no room left every
        # conversation would come back empty and prepare would fail after the engine ran.
        rg, max_length = self.data.regenerate, self.data.max_length
        if rg.enabled and rg.max_new_tokens >= max_length:
            raise ValueError(
                f"data.regenerate.max_new_tokens ({rg.max_new_tokens}) leaves no room for a prompt "
                f"within data.max_length ({max_length}): raise data.max_length or lower max_new_tokens"
            )
        return self

    @property
    def paths(self) -> RunPaths:
        return RunPaths(Path(self.run_dir), Path(self.data.from_run) if self.data.from_run else None)


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
    RECIPE = "recipe.yaml"  # the recipe the run trained with (train/loop.py)
    METRICS = "metrics.jsonl"  # train.logger: jsonl
    BUDGET = "budget.json"  # `eyas budget`
    # In the eval directory.
    EVAL_REPORT = "eval_report.json"
    EVAL_REPORT_MD = "eval_report.md"
    EVAL_PLOT = "eval_report.png"
    EVAL_CONTEXT_PLOT = "eval_by_context.png"
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


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the key."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"override {dotted!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """`["train.lr=2e-4", "data.sources=[a.json]"]` -> [(dotted key, YAML-parsed value)]."""
    parsed = []
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        parsed.append((key.strip(), yaml.safe_load(raw) if raw != "" else None))
    return parsed


def _section_errors(err: ValidationError, prefix: str) -> list[str]:
    out = []
    for e in err.errors():
        loc = ".".join([prefix, *(str(p) for p in e["loc"])])
        msg = e["msg"].removeprefix("Value error, ")
        out.append(f"unknown key '{loc}'" if e["type"] == "extra_forbidden" else f"{loc}: {msg}")
    return out


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid recipe"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{loc}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc or '(top)'}: {msg}")
    return "\n".join(lines)


def recipe_from_dict(tree: dict, source: str = "<dict>", overrides: list[str] | None = None) -> Recipe:
    """Validate a recipe tree (after applying `key.sub=value` overrides)."""
    tree = dict(tree or {})
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as err:
        raise RecipeError(_format_errors(err, source)) from None


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Load a YAML recipe file (None: all defaults) and apply overrides."""
    if path is None:
        return recipe_from_dict({}, "<defaults>", overrides)
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    return recipe_from_dict(tree, str(path), overrides)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML, for saving next to a run's artifacts."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
