"""The offline capture: run the frozen target over a prepared split and write the feature
cache (format in data/cache.py) with the same `compute_features` the online trainer uses.

The work is planned up front and deterministically (samples sorted by length, packed
into batches of <= `batch_tokens` padded tokens, batches grouped into shards of about
`shard_tokens` tokens), so a rerun after a kill skips the shards the manifest already
lists and produces the same manifest as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from eyas.core.run_paths import RunPaths
from eyas.data.cache import (
    FORMAT,
    CaptureError,
    atomic_write,
    bytes_per_token,
    quantize_fp8,
    read_manifest,
    sha256_bytes,
    write_manifest,
)
from eyas.data.capture_plan import plan_capture
from eyas.data.capture_settings import CaptureSettings
from eyas.target.features import compute_features
from eyas.target.load import text_config

log = logging.getLogger(__name__)


class InjectedFailure(RuntimeError):
    """Raised by `fail_after_shards` to test resuming."""


def check_disk(out_dir: Path, needed: int) -> None:
    """Refuse with a clear message when the filesystem cannot hold `needed` more bytes."""
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise CaptureError(
            f"the cache needs about {needed / 1e9:.2f} GB but {probe} has only "
            f"{free / 1e9:.2f} GB free; free space, point run_dir elsewhere, use "
            "data.cache_dtype=fp8, or train with data.features=online"
        )


def _pad_batch(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding: with causal attention, padding at the end never changes the real tokens."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    return ids, mask


def capture_shard(
    model,
    input_ids: Sequence[list[int]],
    loss_mask: Sequence[list[int]],
    batches: list[list[int]],
    aux_layer_ids: Sequence[int],
    aux_dtype: str,
    pad_id: int,
    stored_states: Callable[[int], torch.Tensor | None] | None = None,
    hidden: int | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Run the target over one shard's batches; returns the shard's tensors (cache.py format)
    and how many samples were copied from `stored_states`.

    `stored_states(i)`: sample i's states `[T_i, (n+1)*Ht]` kept from regeneration
    (data/fed_states.py), or None; the target runs only over the samples without them.
    The rows go straight into buffers sized for the whole shard, so no batch's activations
    outlive it (kept views would pin every batch's padded tensors until the shard is saved).
    `model` may be None (with `hidden`, the target's hidden size) when every sample is stored."""
    order = [i for batch in batches for i in batch]
    lengths = [len(input_ids[i]) for i in order]
    total = sum(lengths)
    out: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([t for i in order for t in input_ids[i]], dtype=torch.int32),
        "loss_mask": torch.tensor([t for i in order for t in loss_mask[i]], dtype=torch.uint8),
    }
    hidden = hidden or text_config(model.config).hidden_size
    out["aux"] = torch.empty(total, len(aux_layer_ids) * hidden, dtype=torch.bfloat16)
    out["last"] = torch.empty(total, hidden, dtype=torch.bfloat16)
    copied = 0
    at = 0
    for batch in batches:
        stored = {i: stored_states(i) for i in batch} if stored_states is not None else {}
        run = [i for i in batch if stored.get(i) is None]
        row_of = {i: b for b, i in enumerate(run)}
        if run:
            device = next(model.parameters()).device
            ids, mask = _pad_batch([input_ids[i] for i in run], pad_id)
            aux, last = compute_features(model, ids.to(device), mask.to(device), aux_layer_ids)
        for i in batch:
            n = len(input_ids[i])
            if stored.get(i) is not None:
                out["aux"][at : at + n] = stored[i][:, :-hidden]
                out["last"][at : at + n] = stored[i][:, -hidden:]
                copied += 1
            else:
                b = row_of[i]
                out["aux"][at : at + n] = aux[b, :n]
                out["last"][at : at + n] = last[b, :n]
            at += n
        if run:
            del aux, last
    if aux_dtype == "fp8":
        out["aux"], out["aux_scale"] = quantize_fp8(out["aux"], len(aux_layer_ids))
    out["offsets"] = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    out["sample_index"] = torch.tensor(order, dtype=torch.int64)
    return out, copied


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _shard_intact(out_dir: Path, shard: dict) -> bool:
    """Whether a manifest entry's file is there with its recorded size and sha256 (a warning
    names the shard that is not: it is recomputed)."""
    f = out_dir / shard["file"]
    if not f.is_file():
        problem = "missing"
    elif f.stat().st_size != shard.get("bytes", f.stat().st_size):
        problem = f"{f.stat().st_size} bytes, the manifest says {shard['bytes']}"
    elif sha256_bytes(f.read_bytes()) != shard["sha256"]:
        problem = "checksum mismatch (damaged)"
    else:
        return True
    log.warning("%s: %s; recomputing it", f, problem)
    return False


def capture_split(
    model,
    dataset,
    out_dir: str | Path,
    settings: CaptureSettings,
    fed_states=None,
    engine=None,
    fail_after_shards: int | None = None,
) -> dict:
    """Capture one prepared split (a `datasets.Dataset` with input_ids, loss_mask) into
    `out_dir` as `settings` say; resumes a partial capture of the same plan. Returns the
    final manifest.

    `fed_states`: a `FedStates` of the regeneration that made the split (whose
    `conversation` column names each sample's record); the samples it holds valid states
    for are copied, not run (each shard's manifest entry counts them as copied_samples).
    `engine`: an `EngineStates` (data/capture_engine.py) that hands over the states of the
    samples not copied from `fed_states`, shard by shard; `model` is then None and
    `settings.hidden_size` the target's. `fail_after_shards` stops the capture there (the
    resume tests)."""
    from safetensors.torch import save
    from tqdm.auto import tqdm

    aux_layer_ids, aux_dtype = settings.aux_layer_ids, settings.aux_dtype
    out_dir = Path(out_dir)
    hidden = settings.hidden_size or (
        model.config.get_text_config().hidden_size
        if hasattr(model.config, "get_text_config")
        else model.config.hidden_size
    )
    all_ids, all_masks = list(dataset["input_ids"]), list(dataset["loss_mask"])
    stored_states = None
    if fed_states is not None and len(fed_states) and "conversation" in dataset.column_names:
        conversations = list(dataset["conversation"])

        def stored_states(i: int):
            return fed_states.states_for(conversations[i], all_ids[i], all_masks[i])

    lengths = [len(x) for x in all_ids]
    plan = plan_capture(lengths, settings.batch_tokens, settings.shard_tokens)
    recorded = {
        "aux_layer_ids": list(aux_layer_ids),
        "aux_dtype": aux_dtype,
        "hidden_size": hidden,
        "target": settings.target_name,
    }
    if settings.prepared_digest is not None:  # (absent from caches written before digests)
        recorded["prepared_digest"] = settings.prepared_digest
    if engine is not None:  # (absent from hf caches, so theirs resume as before)
        recorded["backend"] = "vllm"
    fingerprint = plan.fingerprint(recorded)
    manifest = read_manifest(out_dir)
    if manifest is not None and manifest.get("plan") != fingerprint:
        raise CaptureError(
            f"{out_dir} holds a cache of other data or settings; delete it or pass --overwrite to recapture"
        )
    if manifest is None:
        manifest = {
            "format": FORMAT,
            "version": 1,
            **recorded,
            "num_samples": len(lengths),
            "num_tokens": sum(lengths),
            "plan": fingerprint,
            "complete": False,
            "shards": [],
        }
    # A shard counts as done when the manifest lists it and its file holds the bytes the
    # manifest's checksum names; a missing or damaged shard is recomputed, so a rerun repairs
    # what `--verify` names instead of calling the capture complete.
    manifest["complete"] = False
    manifest["shards"] = [s for s in manifest["shards"] if _shard_intact(out_dir, s)]
    have = {s["file"] for s in manifest["shards"]}
    todo = [k for k in range(len(plan.shards)) if _shard_name(k) not in have]
    done = len(plan.shards) - len(todo)
    bpt = bytes_per_token(len(aux_layer_ids), hidden, aux_dtype)
    remaining = sum(plan.shard_tokens(k) for k in todo)
    log.info(
        "capture %s: %d samples, %d tokens in %d shards (%d done); %d bytes/token -> "
        "about %.3f GB still to write",
        out_dir,
        len(lengths),
        sum(lengths),
        len(plan.shards),
        done,
        bpt,
        remaining * bpt / 1e9,
    )
    check_disk(out_dir, remaining * bpt)
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=sum(lengths),
        initial=sum(lengths) - remaining,
        unit="tok",
        desc=f"capture {out_dir.name}",
        disable=not settings.progress,
    )
    written_now = 0
    for k in todo:
        if fail_after_shards is not None and written_now >= fail_after_shards:
            raise InjectedFailure(f"injected failure after {written_now} shards")
        shard_states, from_engine = stored_states, {}
        if engine is not None:
            rows = [i for b in plan.shards[k] for i in b]
            fed = {i: stored_states(i) for i in rows} if stored_states is not None else {}
            keys = {f"{fingerprint[:16]}-{i:08d}": i for i in rows if fed.get(i) is None}
            got = engine.states({key: all_ids[i] for key, i in keys.items()})
            from_engine = {i: got[key] for key, i in keys.items()}

            def shard_states(i: int, fed=fed, from_engine=from_engine):
                return fed[i] if fed.get(i) is not None else from_engine[i]

        tensors, copied = capture_shard(
            model,
            all_ids,
            all_masks,
            plan.shards[k],
            aux_layer_ids,
            aux_dtype,
            settings.pad_id,
            shard_states,
            hidden,
        )
        data = save(tensors)
        name = _shard_name(k)
        atomic_write(out_dir / name, data)
        shard_lengths = [plan.lengths[i] for b in plan.shards[k] for i in b]
        manifest["shards"].append(
            {
                "file": name,
                "sha256": sha256_bytes(data),
                "bytes": len(data),
                "num_samples": len(shard_lengths),
                "num_tokens": sum(shard_lengths),
                "lengths": shard_lengths,
                "copied_samples": copied - len(from_engine),
            }
        )
        manifest["shards"].sort(key=lambda s: s["file"])
        write_manifest(out_dir, manifest)
        if engine is not None:
            engine.done(list(keys))
        written_now += 1
        bar.update(sum(shard_lengths))
    bar.close()
    manifest["complete"] = True
    write_manifest(out_dir, manifest)
    return manifest


def capture(
    recipe,
    splits: Sequence[str] = ("train", "eval"),
    overwrite: bool = False,
    target=None,
    progress: bool = True,
    say: Callable[[str], None] = log.info,
) -> dict[str, dict]:
    """The capture stage for a recipe (DESIGN §2.3): every prepared split of `splits` into
    run_dir/cache/<split>; returns {split: manifest} ({} unless data.features=offline).

    `target` may be passed in (tests, notebooks; a `LoadedTarget`); otherwise it is loaded
    from `recipe.target`. `overwrite` deletes an existing cache of other data first. States
    the regeneration kept (prepared/fed_states) are copied where the tokens match, and
    their directory is removed once every prepared split is captured."""
    from eyas.data.fed_states import FED_STATES_DIR, FedStates, fed_state_layer_ids
    from eyas.data.prepare import load_prepared, read_prepared_digest
    from eyas.target.features import default_aux_layer_ids
    from eyas.target.load import load_recipe_target

    if recipe.data.features != "offline":
        say(
            f"capture: data.features={recipe.data.features}: the trainer takes the states as it "
            "trains; nothing to capture"
        )
        return {}
    prepared, cache = recipe.paths.prepared, recipe.paths.cache
    if recipe.data.from_run:
        from eyas.data.from_run import reused_cache

        return reused_cache(recipe, splits, say)
    if not (prepared / RunPaths.DATASET).is_dir():
        raise CaptureError(f"no prepared data at {prepared}; run `eyas prepare` first")
    dd = load_prepared(prepared)
    splits = [s for s in splits if s in dd]  # an empty eval split is not written
    engine = recipe.data.capture.backend == "vllm"
    if engine:
        from eyas.data.capture_engine import engine_target

        target = engine_target(recipe.target)  # its shape only: the engine holds the weights
    elif target is None:
        target = load_recipe_target(recipe.target, work_rows=recipe.data.capture_batch_tokens)
    aux_ids = list(recipe.data.aux_layer_ids or default_aux_layer_ids(target.num_layers))
    bpt = bytes_per_token(len(aux_ids), target.hidden_size, recipe.data.cache_dtype)
    total = sum(len(x) for s in splits for x in dd[s]["input_ids"])
    say(
        f"capture: aux layers {aux_ids}, {recipe.data.cache_dtype} cache, {bpt} bytes/token x {total} "
        f"tokens = {bpt * total / 1e9:.3f} GB estimated, into {cache}"
    )
    pad = 0 if engine or target.tokenizer.pad_token_id is None else target.tokenizer.pad_token_id
    fed_dir = prepared / FED_STATES_DIR
    fed = None
    if fed_dir.is_dir():
        fed = FedStates(fed_dir, fed_state_layer_ids(aux_ids, target.num_layers), recipe.target.name_or_path)
        say(
            f"capture: {fed_dir} holds the regeneration's states of {len(fed)} conversations; "
            "they are copied where the prepared tokens match"
        )
    settings = CaptureSettings.from_recipe(
        recipe, aux_ids, target.hidden_size, pad, read_prepared_digest(prepared), progress
    )
    manifests = {}
    with contextlib.ExitStack() as stack:
        if engine:  # started at the first shard it is asked for, so a complete cache starts none
            from eyas.data.capture_engine import LazyEngine

            engine = stack.enter_context(LazyEngine(recipe, aux_ids, target.num_layers, say))
        for s in splits:
            if overwrite:
                shutil.rmtree(cache / s, ignore_errors=True)
            m = capture_split(target.model, dd[s], cache / s, settings, fed_states=fed, engine=engine or None)
            copied = sum(sh.get("copied_samples", 0) for sh in m["shards"])
            say(
                f"{cache / s}: {m['num_samples']} samples ({copied} copied from regeneration), "
                f"{m['num_tokens']} tokens, {len(m['shards'])} shards"
            )
            manifests[s] = m
    if fed is not None and all((read_manifest(cache / s) or {}).get("complete") for s in dd):
        # Every prepared split is captured: the states live on in the cache.
        size = sum(f.stat().st_size for f in fed_dir.glob("*"))
        shutil.rmtree(fed_dir)
        say(f"capture: removed {fed_dir} ({size / 1e9:.2f} GB), the cache holds its states now")
    return manifests
