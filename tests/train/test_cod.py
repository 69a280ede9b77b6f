"""COD sampling (DESIGN §4): depth 0 complete, counts by the formula, every kept chain
has its whole prefix, determinism under a seed; the P-EAGLE mask against a brute-force
reference; segments against the unsegmented loss."""

import math

import pytest
import torch

from eyas.train.masks import peagle_dense_mask, peagle_mask_mod, peagle_reference_mask
from eyas.train.peagle import cod_depth_counts, cod_grid, cod_sample, compact


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "n,depths,r,r_min", [(40, 8, 0.8, 0.2), (23, 5, 0.7, 0.0), (12, 10, 0.5, 0.3), (9, 4, 1.0, 0.0)]
)
def test_cod_sample_properties(n, depths, r, r_min):
    kept = cod_sample(n, depths, r, r_min, _gen(3))
    assert len(kept) == depths
    assert torch.equal(kept[0], torch.arange(n))
    for d in range(1, depths):
        prev = set(kept[d - 1].tolist())
        cur = kept[d].tolist()
        assert len(cur) == len(set(cur))
        # prefix integrity: (p, d) kept => (p, d-1) kept, and (p, d) is a real position
        assert all(p in prev and p + d < n for p in cur)
        children = sum(1 for p in prev if p + d < n)
        formula = math.floor((n - d) * max(r**d, r_min))
        assert len(cur) == min(formula, children)


def test_cod_counts_follow_the_formula_when_children_suffice():
    # r_min = 1 keeps everything: every depth has exactly n - d elements
    assert [k.numel() for k in cod_sample(15, 6, 0.5, 1.0, _gen(0))] == [15 - d for d in range(6)]
    assert cod_depth_counts(100, 4, 0.8, 0.2) == [100, 79, 62, 49]
    assert cod_depth_counts(100, 4, 0.3, 0.2) == [100, 29, 19, 19]


def test_cod_sampling_is_deterministic_under_a_seed_and_varies_with_it():
    a = cod_sample(50, 8, 0.7, 0.1, _gen(7))
    b = cod_sample(50, 8, 0.7, 0.1, _gen(7))
    c = cod_sample(50, 8, 0.7, 0.1, _gen(8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_cod_grid_and_compact_layout():
    am = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    keep = cod_grid(am, 4, 0.8, 0.2, _gen(0))
    el = compact(keep, 10)
    for i, n in enumerate([10, 6]):
        real = el.real[i]
        assert int(real.sum()) == int(keep[i].sum())
        # step-0 slots first, in order; then depth-major, anchor-minor
        assert torch.equal(el.anchor[i, :n], torch.arange(n)) and not el.depth[i, :n].any()
        key = (el.depth[i] * 10 + el.anchor[i])[real]
        assert bool((key[1:] > key[:-1]).all())
    with pytest.raises(ValueError, match="row 0"):
        cod_grid(torch.tensor([[1, 0, 1]]), 2, 0.8, 0.2, _gen(0))
    # padded to a multiple (past the grid's 40 cells here): the same elements, then padding
    padded = compact(keep, 10, 64)
    assert padded.real.shape == (2, 64) and int(padded.real.sum()) == int(el.real.sum())
    n = el.real.shape[1]
    for name in ("anchor", "depth", "real"):
        assert torch.equal(getattr(padded, name)[:, :n], getattr(el, name))
    assert not padded.real[:, n:].any() and not padded.anchor[:, n:].any()


def _elements():
    am = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    return compact(cod_grid(am, 5, 0.75, 0.1, _gen(1)), 12)


@pytest.mark.parametrize("window", [None, 1, 3])
def test_peagle_dense_mask_equals_reference(window):
    el = _elements()
    dense = peagle_dense_mask(el.anchor, el.depth, el.real, window)
    assert dense.shape[:2] == (2, 1)
    for i in range(2):
        ref = peagle_reference_mask(el.anchor[i], el.depth[i], el.real[i], window)
        assert torch.equal(dense[i, 0], ref)
    if window is None:
        return
    # a sliding window: (3, 2) at position 5 sees positions 5 - window + 1 .. 5 only
    anchor = torch.tensor([0, 1, 2, 3, 3, 3])
    depth = torch.tensor([0, 0, 0, 0, 1, 2])
    ref = peagle_reference_mask(anchor, depth, torch.ones(6, dtype=torch.bool), window)
    positions = (anchor + depth).tolist()
    assert ref[5].tolist() == [5 - p < window for p in positions]
    # sanity of the rule on a hand-made chain: (3,2) sees (0..3, 0), (3,1), (3,2) only
    anchor = torch.tensor([0, 1, 2, 3, 3, 3, 2])
    depth = torch.tensor([0, 0, 0, 0, 1, 2, 1])
    ref = peagle_reference_mask(anchor, depth, torch.ones(7, dtype=torch.bool))
    assert ref[5].tolist() == [True, True, True, True, True, True, False]
    assert ref[6].tolist() == [True, True, True, False, False, False, True]


@pytest.mark.parametrize("window", [None, 3])
def test_peagle_mask_mod_equals_dense_mask(window):
    from torch.nn.attention.flex_attention import create_mask

    el = _elements()
    b, n = el.anchor.shape
    from_mod = create_mask(peagle_mask_mod(el.anchor, el.depth, el.real, window), b, 1, n, n, device="cpu")
    assert torch.equal(from_mod, peagle_dense_mask(el.anchor, el.depth, el.real, window))
