"""What a training step reads (DESIGN §2.4): each split's sample source (the feature
cache, checked against the prepared data and the head, or the prepared dataset for
online and engine features), its batch stream, and the features and target labels a batch lacks."""

from __future__ import annotations

import logging

import torch

from eyas.core.segments import sample_spans
from eyas.data.from_run import first_conversations
from eyas.data.prepare import read_prepared_digest
from eyas.train.batching import BatchStream, Packing, cache_samples, dataset_samples
from eyas.train.build import FrozenOutput
from eyas.train.fastpath import draft_first_lm_head, label_mask, valid_row_labels

log = logging.getLogger(__name__)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class FeatureSource:
    """Adds aux / last to a batch: already there (offline cache, or the engine's, whose
    client `engine` the batch streams take) or computed by the frozen target (online), and
    the target labels. Which label slots are valid (the target's
    argmax inside the draft vocabulary) is remembered per sample (`batch["index"]`), so
    later epochs multiply only the draft rows of the target's LM head."""

    def __init__(
        self,
        target_model,
        aux_layer_ids: list[int],
        output: FrozenOutput,
        head,
        engine=None,
        label_prompts: bool = False,
    ):
        self.target_model = target_model
        self.label_prompts = label_prompts
        self.engine = engine
        self.aux_layer_ids = aux_layer_ids
        self.output = output
        self.lm_head = draft_first_lm_head(output.lm_head_weight, head.draft_token_ids())
        self._valid: dict[
            tuple[str, int], torch.Tensor
        ] = {}  # (split, index) -> valid label slots [T_i], CPU

    @torch.no_grad()
    def complete(self, batch: dict, split: str = "train"):
        """batch -> (batch with aux/last, TargetLabels). `split` names the source whose
        sample indices `batch["index"]` holds (absent: nothing remembered)."""
        if "aux" not in batch:
            if "segments" in batch:  # recipe.py refuses this; a hand-built stream could not
                raise ValueError("train.packing needs offline features: the target would run across samples")
            from eyas.target.features import compute_features

            batch["aux"], batch["last"] = compute_features(
                self.target_model, batch["input_ids"], batch["attention_mask"], self.aux_layer_ids
            )
        index = batch.pop("index", None)
        segments = batch.get("segments")  # a packed batch: several samples per row
        known = None
        keys = [(split, i) for i in index.tolist()] if index is not None else []
        spans = sample_spans(batch["attention_mask"], segments) if keys else []
        if keys and all(k in self._valid for k in keys):
            known = torch.zeros(batch["loss_mask"].shape, dtype=torch.bool)
            for (row, start, _), k in zip(spans, keys):
                v = self._valid[k]
                known[row, start : start + v.numel()] = v
            known = known.to(batch["loss_mask"].device)
        # `train.label_prompts`: every real slot of a training sample carries the target's
        # label, not the reply's alone; held-out acceptance stays measured on replies
        loss_mask = label_mask(batch, self.label_prompts and split == "train")
        labels = valid_row_labels(
            batch["last"],
            self.output.norm,
            self.lm_head,
            loss_mask,
            batch["attention_mask"],
            known_valid=known,
            segments=segments,
        )
        if keys and known is None:
            for (row, start, end), k in zip(spans, keys):
                self._valid[k] = labels.valid[row, start:end].cpu()
        return batch, labels


def open_split(recipe, head_cfg, split: str):
    """The sample source of a split: the feature cache (offline) or the prepared dataset."""
    paths = recipe.paths
    if recipe.data.features == "offline":
        from eyas.data.cache import FeatureCache, StaleCacheError, resolve_split_dir, stale_cache_problem

        split_dir = resolve_split_dir(paths.cache, split)
        if split != "train" and not (split_dir / "manifest.json").is_file():
            return None
        cache = FeatureCache(paths.cache, split)
        stale = stale_cache_problem(cache.dir, cache.prepared_digest, read_prepared_digest(paths.prepared))
        if stale:
            raise StaleCacheError(stale)
        if (
            cache.aux_layer_ids != list(head_cfg.aux_layer_ids)
            or cache.hidden_size != head_cfg.target_hidden_size
        ):
            raise ValueError(
                f"{cache.dir}: cached aux layers {cache.aux_layer_ids} / hidden {cache.hidden_size} do "
                f"not match the head's {head_cfg.aux_layer_ids} / {head_cfg.target_hidden_size}; "
                "recapture or set data.aux_layer_ids"
            )
        return cache
    from eyas.data.prepare import load_prepared

    dd = load_prepared(paths.prepared)
    if split not in dd or len(dd[split]) == 0:
        if split == "train":
            raise ValueError(f"{paths.prepared}: no train split; run `eyas prepare`")
        return None
    return dd[split]


def batch_stream(recipe, source, rank, world, position=None, pad_id=0, engine=None, split="train"):
    """This rank's stream over a split: the feature cache's samples (offline features) or
    the prepared dataset's, packed as `train.*` says; with `engine` (data.features=engine)
    its batches carry the engine's states (train/engine_feed.py)."""
    packing = Packing.from_train(recipe.train)
    source, lengths, groups = (
        cache_samples(source) if recipe.data.features == "offline" else dataset_samples(source, packing)
    )
    keep = first_conversations(recipe, source) if split == "train" else None
    if keep is not None:
        log.info(
            "data.from_run=%s with data.max_samples=%d: training on the %d of its %d train samples "
            "from its first conversations up to that number",
            recipe.data.from_run,
            recipe.data.max_samples,
            len(keep),
            len(lengths),
        )
        kept = set(keep)
        groups = [g for g in ([i for i in group if i in kept] for group in groups) if g]
    stream = BatchStream(source, lengths, groups, packing, rank, world, pad_id, position)
    if engine is None:
        return stream
    from eyas.train.engine_feed import EngineBatches, key_tag

    n_aux = len(engine.aux_layer_ids)
    tag = key_tag(f"{recipe.paths.root.name}-{split}")
    return EngineBatches(stream, engine, n_aux, recipe.data.capture.prefetch_batches, tag)
