"""Another run's data (data.from_run, DESIGN §2.3): a run that trains on the prepared data
and feature cache of another run checks them here and never writes there, and trains on
the samples of that run's first `data.max_samples` conversations."""

from __future__ import annotations

from collections.abc import Sequence

from eyas.data.cache import CaptureError, read_manifest, stale_cache_problem, verify_cache


def reused_cache(recipe, splits: Sequence[str], say) -> dict[str, dict]:
    """The other run's cache, checked (complete, of its prepared data, every shard's
    checksum), never written: capturing into another run's directory is that run's recipe's work."""
    from eyas.data.prepare import load_prepared, read_prepared_meta

    prepared, cache = recipe.paths.prepared, recipe.paths.cache
    try:
        digest = read_prepared_meta(prepared, made_by=recipe.data.from_run).get("digest")
    except FileNotFoundError as err:
        raise CaptureError(str(err)) from None
    manifests = {}
    for split in [s for s in splits if s in load_prepared(prepared)]:
        manifest = read_manifest(cache / split)
        if manifest is None or not manifest.get("complete"):
            raise CaptureError(
                f"data.from_run={recipe.data.from_run}: no complete {split} cache at {cache / split}; "
                "run `eyas capture` with that run's recipe first"
            )
        stale = stale_cache_problem(cache / split, manifest.get("prepared_digest"), digest)
        if stale:
            raise CaptureError(stale)
        damaged = verify_cache(cache, split)
        if damaged:  # the other run's capture repairs it; this run never writes there
            raise CaptureError(
                f"data.from_run={recipe.data.from_run}: {damaged[0]}; run `eyas capture` with that run's "
                "recipe to recompute it"
            )
        manifests[split] = manifest
    say(f"capture: reading the cache of data.from_run={recipe.data.from_run} ({cache}); nothing to capture")
    return manifests


def first_conversations(recipe, source) -> list[int] | None:
    """data.from_run with data.max_samples N: the positions in `source` (the other run's
    train cache, or its prepared train split) of the samples from that run's first N
    conversations (after its repeats were dropped); None when that is every sample."""
    from eyas.data.cache import FeatureCache
    from eyas.data.prepare import load_prepared

    cfg = recipe.data
    if not cfg.from_run or cfg.max_samples is None:
        return None
    conversation = load_prepared(recipe.paths.prepared)["train"]["conversation"]
    rows = source.sample_rows() if isinstance(source, FeatureCache) else range(len(source))
    keep = [i for i, row in enumerate(rows) if conversation[row] < cfg.max_samples]
    if len(keep) == len(rows):
        return None
    if not keep:
        raise ValueError(
            f"data.max_samples={cfg.max_samples}: none of the {len(rows)} train samples of "
            f"data.from_run={cfg.from_run} comes from its first {cfg.max_samples} conversations"
        )
    return keep
