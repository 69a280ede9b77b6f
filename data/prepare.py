"""The prepare stage: conversations -> (optional regeneration) -> token ids + loss masks,
a deterministic train/eval split, token frequencies and a drop report.

Output directory (`run_dir/prepared`):
  dataset/                 a `datasets.DatasetDict` ("train", "eval"; columns input_ids
                           list[int], loss_mask list[int] of 0/1) — read it with `load_prepared`
  token_freqs.safetensors  {"freqs": int64 [Vt]}: counts of each target id over the masked
                           tokens of the train split — read it with `load_token_frequencies`
  drop_report.json         rows read / kept / dropped per reason (reader and renderer)
  meta.json                target, tokenizer vocabulary size, counts, settings, and
                           `digest` (sha256 of every split's tokens and masks): the capture
                           records it and the trainer compare it (DESIGN §2, fingerprints)
  eval_prompts.jsonl       the eval split's conversations ({"id", "messages"} per line), an
                           `eyas eval --workload` of prompts from the training distribution
  regenerated.jsonl        (regeneration only) the target's replies; resumable
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from eyas.core.run_paths import RunPaths
from eyas.data.conversations import DropReport, NoUsableDataError, read_conversations
from eyas.data.regenerate_settings import RegenerationSettings
from eyas.data.samples import (
    conversation_samples,
    drop_repeated_samples,
    duplicate_indices,
    keep_first_turns,
    split_by_conversation,
    token_frequencies,
)
from eyas.data.templates import TemplateError, render_with_mask

log = logging.getLogger(__name__)


def render_all(
    tokenizer,
    conversations,
    max_length: int,
    train_on: str,
    report: DropReport,
    progress: bool = True,
    truncate: bool = False,
    origins: list[str | None] | None = None,
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Render every conversation -> (input ids, loss masks, index of each sample's
    conversation in `conversations`). Failures are dropped and counted on `report` (named
    by `origins[i]`, where conversation i was read, when given); the samples cut to
    `max_length` (with `truncate`) are counted too.

    `train_on="turns"` makes a sample of each assistant turn (DESIGN §2.1): the
    conversation up to it, rendered as the template renders it when serving that turn, the
    turn alone trained. A conversation is dropped (and counted by reason) when none of its
    turns renders; a turn dropped from a kept conversation is counted in `repaired` as
    `turns_dropped_<reason>`."""
    from tqdm.auto import tqdm

    ids, masks, kept = [], [], []
    for i, conv in enumerate(tqdm(conversations, desc="render", unit="conv", disable=not progress)):
        samples, failed = [], []
        for messages, mode in conversation_samples(tokenizer, conv, train_on):
            try:
                samples.append(render_with_mask(tokenizer, messages, mode, max_length, truncate=truncate))
            except TemplateError as err:
                failed.append(err.reason)
        if not samples:
            report.kept -= 1
            report.drop(failed[0], where=origins[i] if origins else None)
            continue
        for reason in failed:
            report.repaired[f"turns_dropped_{reason}"] += 1
        for r in samples:
            if r.truncated:
                report.repaired["truncated_to_max_length"] += 1
            ids.append(r.input_ids)
            masks.append(r.loss_mask)
            kept.append(i)
    return ids, masks, kept


def prepare(recipe, out_dir: Path | None = None, tokenizer=None, target=None, progress: bool = True) -> dict:
    """Run the prepare stage for a recipe; returns the meta dict written to meta.json.

    `tokenizer` / `target` may be passed in (tests, notebooks); otherwise the tokenizer
    is loaded from `recipe.target`, and the whole target only when regenerating.
    """
    import datasets
    from safetensors.torch import save_file

    from eyas.target.load import load_recipe_target, load_tokenizer

    cfg = recipe.data
    if cfg.from_run and out_dir is None:
        return read_prepared_meta(recipe.paths.prepared, made_by=cfg.from_run)
    out_dir = Path(out_dir or recipe.paths.prepared)
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations, report = gather_conversations(cfg)
    source_index = list(range(len(conversations)))  # a conversation's index in regenerated.jsonl
    if cfg.regenerate.enabled:
        if target is None and cfg.regenerate.backend == "hf":
            target = load_recipe_target(recipe.target, work_rows=cfg.regenerate.batch_size)
        tokenizer = tokenizer or (target.tokenizer if target is not None else None)
        from eyas.data.regenerate import regenerate

        settings = regeneration_settings(recipe, target, out_dir, progress)
        tokenizer = tokenizer or load_tokenizer(
            recipe.target.name_or_path, recipe.target.revision, recipe.target.trust_remote_code
        )
        conversations = regenerate(
            conversations,
            tokenizer,
            out_dir / RunPaths.REGENERATED,
            settings,
            model=target.model if target is not None else None,
            token_checks=report.token_checks,
        )
        # a conversation that ended where the target's tool calls left the record is kept, cut
        if report.token_checks.get("tool_divergence"):
            report.repaired["tool_divergence"] += report.token_checks.pop("tool_divergence")
        if report.token_checks:
            log.info("regenerated turns against the server's token ids: %s", dict(report.token_checks))
        # Regeneration ends a conversation before a prompt too long to fit max_length, or
        # at an empty reply; one left with no assistant turn has nothing to train on.
        for i, c in enumerate(conversations):
            if not any(m["role"] == "assistant" for m in c):
                report.kept -= 1
                report.drop("regenerated_nothing_to_train", where=report.kept_rows[i])
        source_index = [i for i, c in enumerate(conversations) if any(m["role"] == "assistant" for m in c)]
        conversations = [conversations[i] for i in source_index]
        report.kept_rows = [report.kept_rows[i] for i in source_index]
    if tokenizer is None:
        tokenizer = load_tokenizer(
            recipe.target.name_or_path, recipe.target.revision, recipe.target.trust_remote_code
        )
    ids, masks, kept = render_all(
        tokenizer,
        conversations,
        cfg.max_length,
        cfg.train_on,
        report,
        progress,
        truncate=cfg.over_length == "truncate",
        origins=report.kept_rows,
    )
    if cfg.train_on == "turns" and cfg.dedupe:
        ids, masks, kept, repeated = drop_repeated_samples(ids, masks, kept)
        if repeated:
            report.repaired["turns_dropped_duplicate"] += repeated
    (out_dir / RunPaths.DROP_REPORT).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    log.info("prepared: %s", report.summary())
    if not ids:
        raise NoUsableDataError(f"no conversation survived rendering: {report.summary()}")
    train_idx, eval_idx = split_by_conversation(kept, cfg.eval_fraction, cfg.seed)
    # `conversation`: where a sample came from (its index after dedupe, the `index` of its
    # regenerated.jsonl record), for reports and for the capture's regeneration states.
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("uint8")),
            "conversation": datasets.Value("int64"),
        }
    )

    def split(idx):
        return datasets.Dataset.from_dict(
            {
                "input_ids": [ids[i] for i in idx],
                "loss_mask": [masks[i] for i in idx],
                "conversation": [source_index[kept[i]] for i in idx],
            },
            features=features,
        )

    # An empty split is left out: `datasets` cannot reload a zero-row Arrow split.
    dd = datasets.DatasetDict(
        {name: split(idx) for name, idx in (("train", train_idx), ("eval", eval_idx)) if idx}
    )
    dd.save_to_disk(str(out_dir / RunPaths.DATASET))
    # The held-out conversations as an eval workload (`eyas eval --workload <this file>`):
    # what the trainer's held-out accuracy predicts, beside MT-bench's shift of topic.
    with open(out_dir / RunPaths.EVAL_PROMPTS, "w", encoding="utf-8") as f:
        for i in eval_idx:
            if i and kept[i - 1] == kept[i]:
                continue  # one prompt per conversation (train_on: turns makes several samples)
            f.write(
                json.dumps({"id": f"eval-{i}", "messages": conversations[kept[i]]}, ensure_ascii=False) + "\n"
            )
    vocab = max(len(tokenizer), max(max(r) for r in ids) + 1, _config_vocab_size(recipe))
    freqs = token_frequencies([ids[i] for i in train_idx], [masks[i] for i in train_idx], vocab)
    save_file({"freqs": freqs}, str(out_dir / RunPaths.TOKEN_FREQS))
    meta = {
        "digest": prepared_digest({"train": train_idx, "eval": eval_idx}, ids, masks),
        "target": recipe.target.name_or_path,
        "tokenizer_vocab_size": vocab,
        "train": len(train_idx),
        "eval": len(eval_idx),
        "train_tokens": sum(len(ids[i]) for i in train_idx),
        "masked_train_tokens": int(freqs.sum()),
        "max_length": cfg.max_length,
        "train_on": cfg.train_on,
        "drop_report": report.as_dict(),
    }
    (out_dir / RunPaths.PREPARED_META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def gather_conversations(cfg, max_samples: int | None = None):
    """The conversations `prepare` regenerates and renders, with their drop report: the first
    `max_samples` (default `data.max_samples`) read, cut to `max_turns`, repeats dropped.
    Reading fewer gives a prefix of reading more, so regenerated.jsonl's indices hold."""
    conversations, report = read_conversations(
        cfg.sources, cfg.format, max_samples or cfg.max_samples, bad_encoding=cfg.bad_encoding
    )
    log.info("read: %s", report.summary())
    if cfg.max_turns is not None:
        conversations = [keep_first_turns(c, cfg.max_turns) for c in conversations]
    if cfg.dedupe:
        repeats = set(duplicate_indices(conversations, prompts_only=cfg.regenerate.enabled))
        for i in sorted(repeats):
            report.kept -= 1
            report.drop("duplicate", where=report.kept_rows[i])
        conversations = [c for i, c in enumerate(conversations) if i not in repeats]
        report.kept_rows = [r for i, r in enumerate(report.kept_rows) if i not in repeats]
    return conversations, report


def regeneration_settings(recipe, target, out_dir: Path, progress: bool = True) -> RegenerationSettings:
    """`regenerate()`'s settings from a recipe's `data.regenerate`, for `target` (None with
    the server backend); shared by `prepare` and the time-budget probe (eyas/budget/probe.py)."""
    cfg, rg = recipe.data, recipe.data.regenerate
    states_dir = layer_ids = None
    if rg.keep_states and (cfg.features != "offline" or target is None):
        log.warning(
            "data.regenerate.keep_states needs the hf backend and data.features=offline; "
            "the capture will run the target itself"
        )
    elif rg.keep_states:
        from eyas.data.fed_states import FED_STATES_DIR, fed_state_layer_ids
        from eyas.target.features import default_aux_layer_ids

        states_dir = out_dir / FED_STATES_DIR
        layer_ids = fed_state_layer_ids(
            cfg.aux_layer_ids or default_aux_layer_ids(target.num_layers), target.num_layers
        )
    temperature, top_p = regeneration_sampling(recipe, target)
    return RegenerationSettings(
        backend=rg.backend,
        batch_size=rg.batch_size,
        batch_tokens=rg.batch_tokens,
        max_new_tokens=rg.max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=rg.seed,
        reasoning_effort=rg.reasoning_effort,
        progress=progress,
        max_prompt_tokens=max(1, cfg.max_length - rg.max_new_tokens),
        states_dir=states_dir,
        state_layer_ids=layer_ids,
        target_name=recipe.target.name_or_path,
        server=server_settings(rg, out_dir) if rg.backend == "server" else None,
    )


def regeneration_sampling(recipe, target=None) -> tuple[float, float]:
    """The (temperature, top_p) replies are drawn with: the recipe's, where it sets them,
    else the target's own generation_config (target/load.py::target_sampling)."""
    from eyas.target.load import target_sampling

    rg = recipe.data.regenerate
    if rg.temperature is not None and rg.top_p is not None:
        return rg.temperature, rg.top_p
    temperature, top_p = target_sampling(recipe.target, target.model if target is not None else None)
    chosen = (
        rg.temperature if rg.temperature is not None else temperature,
        rg.top_p if rg.top_p is not None else top_p,
    )
    log.info("regeneration samples at temperature %g, top_p %g (the target's generation_config)", *chosen)
    return chosen


def server_settings(rg, out_dir: Path):
    """The server backend's settings from a recipe's `data.regenerate`; with `launch`, the
    engine it starts (only when some conversation is left to regenerate), logging to
    `out_dir/engine.log`."""
    from eyas.data.regenerate_settings import ServerSettings

    engine = None
    if rg.launch:
        from eyas.core.engine_process import launched_engine

        def engine():
            return launched_engine(
                rg.launch, rg.server_urls, out_dir / RunPaths.ENGINE_LOG, rg.launch_timeout_s
            )

    return ServerSettings(
        urls=list(rg.server_urls),
        model=rg.server_model,
        concurrency=rg.concurrency,
        timeout_s=rg.request_timeout_s,
        max_retries=rg.max_retries,
        engine=engine,
    )


def _config_vocab_size(recipe) -> int:
    """The target's vocabulary (embedding rows, often padded past the tokenizer's length),
    so the frequency vector lines up with the LM head."""
    from transformers import AutoConfig

    from eyas.target.load import resolve_target_path, text_config

    try:
        cfg = AutoConfig.from_pretrained(
            resolve_target_path(recipe.target.name_or_path), trust_remote_code=recipe.target.trust_remote_code
        )
        return int(text_config(cfg).vocab_size)
    except Exception:  # no config reachable (tokenizer-only tests): the tokenizer decides
        return 0


def prepared_digest(splits: dict[str, list[int]], ids: list[list[int]], masks: list[list[int]]) -> str:
    """sha256 of what a prepared directory holds for training: each split's rows, in order,
    as token ids and loss masks. Two prepares of other data never share it."""
    import numpy as np

    h = hashlib.sha256()
    for name in sorted(splits):
        h.update(f"split {name} {len(splits[name])}\n".encode())
        for i in splits[name]:
            h.update(np.asarray(ids[i], dtype=np.int64).tobytes())
            h.update(np.asarray(masks[i], dtype=np.uint8).tobytes())
            h.update(len(ids[i]).to_bytes(8, "little"))
    return h.hexdigest()


def read_prepared_meta(path: str | Path, made_by: str | None = None) -> dict:
    """A finished prepared directory's meta.json (what `prepare` returned when it wrote it).
    `made_by`: the run that should have written it (data.from_run), named when it is absent."""
    meta = Path(path) / RunPaths.PREPARED_META
    if not meta.is_file():
        whose = f"data.from_run={made_by} has" if made_by else "there is"
        raise FileNotFoundError(
            f"{whose} no finished prepared data ({meta} is missing); run `eyas prepare` with "
            "that run's recipe first"
        )
    try:
        loaded = json.loads(meta.read_text())
    except json.JSONDecodeError as err:
        raise NoUsableDataError(f"{meta}: damaged ({err}); rerun `eyas prepare`") from None
    if not isinstance(loaded, dict):
        raise NoUsableDataError(f"{meta}: damaged (not a JSON object); rerun `eyas prepare`")
    return loaded


def read_prepared_digest(path: str | Path) -> str | None:
    """The digest in a prepared directory's meta.json (None: no meta.json, or written
    before digests were recorded)."""
    if not (Path(path) / RunPaths.PREPARED_META).is_file():
        return None
    return read_prepared_meta(path).get("digest")


def load_prepared(path: str | Path):
    """The prepared `datasets.DatasetDict` ("train", "eval"; input_ids, loss_mask).
    `path` is the prepared directory (or its dataset/ subdirectory)."""
    import datasets

    path = Path(path)
    if (path / RunPaths.DATASET).is_dir():
        path = path / RunPaths.DATASET
    return datasets.load_from_disk(str(path))


def load_token_frequencies(path: str | Path) -> torch.Tensor:
    """Masked-token counts [Vt] int64 of the train split (input to heads.vocab.build_vocab_map);
    Vt = max(tokenizer length, the target config's vocab_size)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / RunPaths.TOKEN_FREQS
    return load_file(str(path))["freqs"]
