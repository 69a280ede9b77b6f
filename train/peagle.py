"""P-EAGLE training (DESIGN §4): COD sampling of (anchor, depth) elements, their inputs
and labels, and the loss, optionally split into segments along the anchors.

Interpretation of COD. The chain of anchor p is (p, 0), (p, 1), …, (p, d): depth d drafts
the token at p + d + 2 from x_{p+1}, the features at p and d mask slots. In DESIGN §4 the
"child" of an element at depth d-1 is the next *position* (p+d-1 → p+d), i.e. the element
of the same anchor one depth deeper. So the kept set is prefix-closed per anchor:
(p, d) is kept only if (p, d-1) is. With n real slots, (p, d) exists for p + d < n (its
position is a real slot), so depth d has n - d candidates and keeps
min(⌊(n - d) · max(r^d, r_min)⌋, children of depth d-1 that exist) of them, drawn
uniformly without replacement from those children (with `cod_labelled_only`, from the
children on a chain that carries a label: `labelled_chains`). Depth 0 keeps every real
slot.

Layout. Per sample, elements live on a grid of D·T cells (cell d·T + p = (p, d)); the kept
cells are compacted in that order (depth-major, anchor-minor) and padded to the longest
sample, so the first T entries of every sample are its step-0 slots.

Packed rows (`train.packing`, `segments` in the batch, DESIGN §3): COD runs per sample, in
row order (the generator draws what it draws for the same samples in separate rows), an
element's position is counted from its sample's start, a depth-0 key counts only for
queries of its own sample, and an element whose label slot lies in the next sample has
no label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from eyas.core.segments import sample_spans, segment_starts
from eyas.heads.peagle import PEagleHead
from eyas.train.batching import round_up
from eyas.train.fastpath import ROW_MULTIPLE, padded_rows
from eyas.train.losses import TargetLabels, loss_rows, loss_terms_rows
from eyas.train.masks import peagle_block_mask, peagle_dense_mask
from eyas.train.step_stats import StepStats


def cod_depth_counts(n_valid: int, num_depths: int, r: float, r_min: float) -> list[int]:
    """The formula's count per depth: n_valid at depth 0, ⌊(n_valid - d)·max(r^d, r_min)⌋
    after (before clamping to the children that exist)."""
    counts = [n_valid]
    for d in range(1, num_depths):
        # the epsilon keeps 0.7 * 10 from flooring to 6 through rounding error
        counts.append(max(0, math.floor((n_valid - d) * max(r**d, r_min) + 1e-9)))
    return counts


def cod_sample(
    n_valid: int,
    num_depths: int,
    r: float,
    r_min: float,
    generator: torch.Generator | None = None,
    useful: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Kept anchors per depth for one sequence of n_valid real slots: a list of
    num_depths sorted long tensors (depth 0 = arange(n_valid)); prefix-closed per anchor.
    `useful` [num_depths, n_valid] bool (`labelled_chains`): a deeper element is drawn
    only among anchors marked at its depth; None: among all."""
    device = generator.device if generator is not None else torch.device("cpu")
    targets = cod_depth_counts(n_valid, num_depths, r, r_min)
    kept = [torch.arange(n_valid, device=device)]
    for d in range(1, num_depths):
        children = kept[-1][kept[-1] + d < n_valid]
        if useful is not None:
            children = children[useful[d, children.cpu()].to(children.device)]
        count = min(targets[d], children.numel())
        pick = torch.randperm(children.numel(), generator=generator, device=device)[:count]
        kept.append(children[pick].sort().values)
    return [k.cpu() for k in kept]


@dataclass
class PEagleElements:
    """Flattened training elements of a batch, padded to L: anchor / depth [B, L] long,
    real [B, L] bool (False = padding; its anchor/depth are 0). A packed batch adds
    row_starts [B, T] (`segment_starts` of the slots) and start [B, L], the first slot of
    each element's sample."""

    anchor: torch.Tensor
    depth: torch.Tensor
    real: torch.Tensor
    row_starts: torch.Tensor | None = None
    start: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        if self.start is None:
            return self.anchor + self.depth
        return self.anchor - self.start + self.depth

    def attention_mask(self, window: int | None = None):
        """The P-EAGLE rule (with the head's sliding window) as a flex BlockMask on CUDA, a
        dense [B, 1, L, L] elsewhere."""
        if self.anchor.is_cuda:
            return peagle_block_mask(self.anchor, self.depth, self.real, window, self.start)
        return peagle_dense_mask(self.anchor, self.depth, self.real, window, self.start)


def labelled_chains(valid: torch.Tensor, num_depths: int) -> torch.Tensor:
    """valid [B, T] label slots -> useful [B, D, T] bool: (p, d) or a deeper element of
    anchor p carries a label (element (p, d') learns slot p + d' + 1). An element that is
    not useful adds nothing to the loss: it has no label, and the only elements that read
    it are the deeper ones of its own anchor, which have none either."""
    b, t = valid.shape
    labelled = torch.zeros(b, num_depths, t, dtype=torch.bool)
    v = valid.bool().cpu()
    for d in range(num_depths):
        if d + 1 < t:
            labelled[:, d, : t - d - 1] = v[:, d + 1 :]
    # useful at d: labelled at some d' >= d (a suffix "or" over the depths)
    return labelled.flip(1).to(torch.int8).cummax(1).values.flip(1).bool()


def cod_grid(
    attention_mask: torch.Tensor,
    num_depths: int,
    r: float,
    r_min: float,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """attention_mask [B, T] (right padding) -> keep [B, D·T] bool, cell d·T + p = (p, d).
    `valid` [B, T] (the labels' valid slots): deeper elements only on `labelled_chains`.
    `segments` [B, T] (a packed batch): each sample is sampled as if alone, in row order."""
    b, t = attention_mask.shape
    if segments is not None:
        keep = torch.zeros(b, num_depths, t, dtype=torch.bool)
        for row, a, e in sample_spans(attention_mask, segments):
            mine = labelled_chains(valid[row : row + 1, a:e], num_depths)[0] if valid is not None else None
            for d, anchors in enumerate(cod_sample(e - a, num_depths, r, r_min, generator, mine)):
                keep[row, d, a + anchors] = True
        return keep.view(b, num_depths * t).to(attention_mask.device)
    lengths = attention_mask.bool().sum(1).tolist()
    useful = labelled_chains(valid, num_depths) if valid is not None else None
    keep = torch.zeros(b, num_depths, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if not bool(attention_mask[i, :n].bool().all()):
            raise ValueError(f"P-EAGLE needs right-padded batches; attention_mask row {i} has a gap")
        mine = useful[i, :, :n] if useful is not None else None
        for d, anchors in enumerate(cod_sample(int(n), num_depths, r, r_min, generator, mine)):
            keep[i, d, anchors] = True
    return keep.view(b, num_depths * t).to(attention_mask.device)


def compact(
    keep: torch.Tensor, t: int, multiple: int = 1, row_starts: torch.Tensor | None = None
) -> PEagleElements:
    """keep [B, D·T] -> the kept cells of each sample in grid order, padded to the longest
    and then to a multiple of `multiple` (the loss passes ROW_MULTIPLE: the element count
    is drawn anew for every batch, and CPU kernels are built per shape). `row_starts`
    [B, T] (a packed batch, `segment_starts`): each element's sample start is kept."""
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    counts = keep.sum(1, keepdim=True)
    length = round_up(max(int(counts.max()), 1), multiple)
    if length > order.shape[1]:
        order = torch.cat([order, order.new_zeros(order.shape[0], length - order.shape[1])], dim=1)
    cells = order[:, :length]
    real = torch.arange(length, device=keep.device)[None] < counts
    anchor = torch.where(real, cells % t, 0)
    depth = torch.where(real, cells // t, 0)
    start = None if row_starts is None else torch.where(real, row_starts.gather(1, anchor), 0)
    return PEagleElements(anchor=anchor, depth=depth, real=real, row_starts=row_starts, start=start)


def element_inputs(head: PEagleHead, elements: PEagleElements, input_ids: torch.Tensor, aux: torch.Tensor):
    """Token ids [B, L] (x_{p+1} at depth 0, the mask id deeper) and hidden inputs
    [B, L, H] (fc of the target features at p at depth 0, fc of `mask_hidden` deeper)."""
    b, t = input_ids.shape
    deep = elements.depth > 0
    nxt = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, 1)], dim=1)
    mask_ids, mask_aux = head.mask_slot_inputs(1, 1, input_ids.device)
    tokens = torch.where(deep, mask_ids.view(1, 1), nxt.gather(1, elements.anchor))
    # only the slots some element reads, in few distinct widths (kernels are built per shape)
    span = min(t, round_up(int(elements.anchor.max()) + 1, ROW_MULTIPLE))
    g = head.combine_aux(aux[:, :span])
    g_mask = head.combine_aux(mask_aux)  # [1, 1, H]
    idx = elements.anchor.clamp(max=span - 1)[..., None].expand(-1, -1, g.shape[-1])
    hidden = torch.where(deep[..., None], g_mask.to(g.dtype), g.gather(1, idx))
    return tokens, hidden


def element_label_slots(elements: PEagleElements, labels: TargetLabels) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot [B, L], valid [B, L]): element (p, d) learns target slot p + d + 1 (of its own
    sample: in a packed row, the slot after a sample's last one is the next sample's)."""
    t = labels.valid.shape[1]
    slot = elements.anchor + elements.depth + 1
    inside = elements.real & (slot < t)
    slot = slot.clamp(max=t - 1)
    if elements.start is not None:
        inside = inside & (elements.row_starts.gather(1, slot) == elements.start)
    return slot, inside & labels.valid.gather(1, slot)


def peagle_hidden(head: PEagleHead, elements: PEagleElements, input_ids, aux) -> torch.Tensor:
    """The head's last hidden state [B, L, H] of every element, in one pass under the
    P-EAGLE mask (before the final norm)."""
    tokens, hidden = element_inputs(head, elements, input_ids, aux)
    return head.forward_layers(
        tokens,
        hidden,
        elements.positions,
        head.new_cache(),
        elements.attention_mask(head.config.sliding_window),
    )


def peagle_forward(head: PEagleHead, elements: PEagleElements, input_ids, aux) -> torch.Tensor:
    """Logits [B, L, Vd] of every element, in one pass under the P-EAGLE mask."""
    return head.lm_head(head.norm(peagle_hidden(head, elements, input_ids, aux)))


def segment_keeps(keep: torch.Tensor, t: int, num_depths: int, segment_length: int | None):
    """Split keep [B, D·T] into segments of `segment_length` anchors. Segment [a0, a1)
    holds the depth-0 cells of anchors < a1 (the prefix its queries attend to) and the
    deeper cells of anchors in [a0, a1); yields (cells, loss cells) pairs [B, D·T] where
    loss cells are the ones whose loss the segment owns (anchors in [a0, a1))."""
    anchors = torch.arange(t, device=keep.device).repeat(num_depths)[None]
    depth0 = (torch.arange(num_depths * t, device=keep.device) < t)[None]
    step = segment_length or t
    last = int(keep[:, :t].sum(1).max()) if keep.numel() else 0
    for a0 in range(0, max(last, 1), step):
        a1 = a0 + step
        own = keep & (anchors >= a0) & (anchors < a1)
        yield keep & ((depth0 & (anchors < a1)) | own), own


def _segment_loss(
    head, elements: PEagleElements, bi, li, target_rows, input_ids, aux, weight, depth, train_cfg
):
    """The segment's share of the loss (its per-element `train.loss` weighted by `weight`
    [N]) plus, detached, the per-element loss [N] and draft argmax [N] for elements
    (bi, li) of depths `depth` [N] (the LK weight is one per depth, over this segment's
    elements). The LM head and the loss run on those N rows only (most of a segment's
    elements are padding or have no label), rounded up to ROW_MULTIPLE with weight-0
    copies of row 0."""
    h = peagle_hidden(head, elements, input_ids, aux)
    n = bi.numel()
    if n == 0:
        # a zero that still reaches every parameter, so DDP sees each one used
        empty = h.new_zeros(0)
        return head.lm_head(head.norm(h[:, :1])).sum() * 0.0, empty, empty.long()
    bi, li, weight = padded_rows(bi, fill=0), padded_rows(li, fill=0), padded_rows(weight, fill=0)
    group = padded_rows(depth, fill=-1)  # the added rows count in no depth's LK weight
    target_rows = padded_rows(target_rows)
    rows = head.lm_head(head.norm(h[bi, li]))
    acc = torch.promote_types(rows.dtype, torch.float32)  # >= fp32 under bf16 autocast
    probs = torch.softmax(target_rows.to(acc), dim=-1)
    ce, tv, top = loss_terms_rows(rows, probs, train_cfg.loss, train_cfg.compile_loss)
    per_row = loss_rows(train_cfg.loss, ce, tv, group, train_cfg.lk_eta)
    return (per_row * weight.to(per_row.dtype)).sum(), per_row.detach()[:n], top[:n]


def element_weights(
    elements: PEagleElements, labels: TargetLabels, depths: int, weighting: str
) -> torch.Tensor:
    """Loss weight of one element per depth [D]: 1 / (elements with a label) for "element";
    1 / (depths with a labelled element · that depth's labelled elements) for "depth". Both
    sum to 1 over the batch, so the loss's scale does not depend on the choice."""
    valid = element_label_slots(elements, labels)[1]
    counts = torch.bincount(elements.depth[valid], minlength=depths).double()
    if weighting == "element":
        return torch.full(
            (depths,), 1.0 / max(float(counts.sum()), 1.0), dtype=torch.float64, device=valid.device
        )
    present = int((counts > 0).sum())
    return torch.where(counts > 0, 1.0 / (counts.clamp(min=1) * max(present, 1)), 0.0)


def _segments_on_every_rank(head, n: int, device) -> int:
    """The most segments any rank runs for its micro-batch when the head is sharded (FSDP2
    or ZeRO-3 gather a layer's weights on every call, a collective): each rank then runs
    that many, so no rank waits on a gather the others never start. `n` otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    from eyas.train.checkpoint import is_fsdp

    if not (any(is_fsdp(m) for m in head.modules()) or any(hasattr(p, "ds_id") for p in head.parameters())):
        return n
    most = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def peagle_loss(
    head: PEagleHead, batch: dict, labels: TargetLabels, train_cfg, generator: torch.Generator | None
) -> StepStats:
    """COD-sampled P-EAGLE loss of a batch: the weighted mean `train.loss` over every
    kept element whose label slot is valid (`element_weights`: each element alike, or each
    depth alike), with per-depth losses, hits and counts.

    batch: input_ids / attention_mask [B, T], aux [B, T, n·Ht]; labels from
    `target_labels`; train_cfg.section("peagle"): num_depths, cod_r, cod_r_min,
    segment_length (anchors per segment; None = one segment), loss_weighting. The caller
    runs one backward on `stats.loss` as for any algorithm. With several segments each
    one's forward runs under activation checkpointing, so only one segment's activations
    are alive at a time (recomputed during that backward); the loss and gradients equal
    the unsegmented ones.
    """
    input_ids, am, aux = batch["input_ids"], batch["attention_mask"], batch["aux"]
    t = input_ids.shape[1]
    cfg = train_cfg.section("peagle")
    depths = cfg.num_depths
    valid = labels.valid if cfg.cod_labelled_only else None
    segments = batch.get("segments")
    starts = None if segments is None else segment_starts(segments)
    keep = cod_grid(am, depths, cfg.cod_r, cfg.cod_r_min, generator, valid, segments)
    depth_weight = element_weights(compact(keep, t, row_starts=starts), labels, depths, cfg.loss_weighting)
    segments = list(segment_keeps(keep, t, depths, cfg.segment_length))
    real_segments = len(segments)
    segments += segments[:1] * (_segments_on_every_rank(head, real_segments, aux.device) - real_segments)
    loss_sum = torch.zeros(depths, dtype=torch.float64)
    hits = torch.zeros(depths, dtype=torch.long)
    counts = torch.zeros(depths, dtype=torch.long)
    loss = None
    for n, (cells, own) in enumerate(segments):
        elements = compact(cells, t, ROW_MULTIPLE, starts)
        owned = own.gather(1, elements.depth * t + elements.anchor) & elements.real
        slot, valid = element_label_slots(elements, labels)
        bi, li = (valid & owned).nonzero(as_tuple=True)
        rows = slot[bi, li]
        args = (
            head,
            elements,
            bi,
            li,
            labels.logits[bi, rows],
            input_ids,
            aux,
            depth_weight[elements.depth[bi, li]],
            elements.depth[bi, li],
            train_cfg,
        )
        if len(segments) > 1:
            seg_loss, ce, pred = checkpoint(_segment_loss, *args, use_reentrant=False)
        else:
            seg_loss, ce, pred = _segment_loss(*args)
        if n >= real_segments:
            # a repeat that only keeps this rank's layer calls in step with the others
            loss = loss + seg_loss * 0.0
            continue
        loss = seg_loss if loss is None else loss + seg_loss
        d = elements.depth[bi, li].cpu()
        loss_sum.index_add_(0, d, ce.double().cpu())
        hits.index_add_(0, d, (pred == labels.argmax[bi, rows]).long().cpu())
        counts.index_add_(0, d, torch.ones_like(d))
    per_depth = (loss_sum / counts.clamp(min=1)).tolist()
    return StepStats(
        loss=loss, step_losses=per_depth, hits=hits.tolist(), counts=counts.tolist(), tokens=int(am.sum())
    )
