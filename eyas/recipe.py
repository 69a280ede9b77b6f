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
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from eyas.core.problems import problem_lines
from eyas.core.run_paths import RunPaths
from eyas.heads.algorithms import AlgorithmSection
from eyas.recipe_data import (  # noqa: F401  (their names stay importable from here)
    CaptureSection,
    DataSection,
    ReasoningEffort,
    RegenerateSection,
)
from eyas.recipe_data import StrictSection as _Section

# Drafted tokens per step: vLLM verifies K+1 positions per sequence; past a few dozen no
# head accepts anything, so a larger K is a typo.
MAX_K = 64
Beta = Annotated[float, Field(ge=0, lt=1)]  # an Adam moment decay


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
    # What each drafted position is trained to match (DESIGN §2.4): kl, the soft-label
    # cross-entropy against the target (forward KL); tv, the total variation, 1 - the
    # acceptance rate of speculative sampling; lk, exp(-lk_eta·acceptance)·kl + the rest·tv,
    # per TTT step or P-EAGLE depth (the LK loss, arXiv 2602.23881).
    loss: Literal["kl", "tv", "lk"] = "kl"
    lk_eta: float = Field(3.0, ge=0)
    # Also train on the prompt's slots (system / user text), labelled like the reply's by
    # the target's own distribution there (DESIGN §2.4): more labelled slots from the same
    # regenerated data. The held-out split keeps the reply-only mask.
    label_prompts: bool = False
    # adamw: every trainable parameter. muon: torch.optim.Muon for the head's 2-D hidden
    # matrices (attention, MLP, fc) at `muon_lr`, AdamW for the rest (train/optimizers.py);
    # refused under FSDP2 and DeepSpeed, which shard the matrices.
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = Field(0.02, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    freeze_lm_head: bool = False  # keep the LM head rows copied from the target
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    warmup_steps: int = Field(100, ge=0)
    max_steps: int | None = Field(None, ge=1)  # None: epochs decide
    # Stop after this many minutes of training steps in this process, as a job's or a time
    # budget's wall clock requires: the run saves its checkpoint and final head there, and a
    # rerun resumes from it. None: the steps decide.
    max_minutes: float | None = Field(None, gt=0)
    epochs: float = Field(1.0, gt=0)
    batch_tokens: int = Field(8192, ge=1)  # tokens per micro-batch (length-bucketed)
    max_batch_size: int = Field(64, ge=1)
    # Concatenate short samples into rows of up to batch_tokens tokens (one row per
    # micro-batch; max_batch_size unused), each sample still seen alone: positions restart
    # and attention stops at its boundary (DESIGN §3). Offline features only.
    packing: bool = False
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
                raise ValueError("; ".join(problem_lines(err, f"train.{name}"))) from None
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
    # Under greedy, how many prompts (evenly spaced) every drafter decodes against the
    # target: tok/s and the lossless check come from those. On the others each is replayed
    # over the plain greedy tokens, the same acceptance for a fraction of the time (DESIGN
    # §6). None: all decoded. Sampled evals decode every prompt.
    decoded_prompts: PositiveInt | None = None
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
    def _packing_needs_offline_features(self) -> Recipe:
        # The target (online) and the engine run on the batch's rows: over a packed row its
        # attention would cross from one sample into the next, so the states would not be
        # those of each sample alone. The cache stores every sample's states computed apart.
        if self.train.packing and self.data.features != "offline":
            raise ValueError(
                f"train.packing needs data.features: offline (got {self.data.features!r}): the "
                f"{self.data.features} features run the target over a packed row, across sample "
                "boundaries; capture the features offline, or set train.packing: false"
            )
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

    def to_yaml(self) -> str:
        """The recipe as YAML, for saving next to a run's artifacts (a method, so the trainer
        writes it without importing this module)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


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


def _format_errors(err: ValidationError, source: str) -> str:
    return "\n".join([f"{source}: invalid recipe", *(f"  {line}" for line in problem_lines(err))])


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
