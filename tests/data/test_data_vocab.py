"""The draft vocabulary map (heads/vocab.py)."""

import subprocess
import sys

import torch

from eyas.heads.vocab import build_vocab_map


def test_most_frequent_tokens_sorted_with_offsets():
    freqs = torch.tensor([0, 5, 1, 9, 0, 3, 7, 2])
    vm = build_vocab_map(freqs, 4)
    assert vm.draft_ids.tolist() == [1, 3, 5, 6]
    assert vm.d2t.dtype == torch.int64 and vm.d2t.tolist() == [1, 2, 3, 3]
    assert vm.t2d.dtype == torch.bool and vm.t2d.nonzero().flatten().tolist() == [1, 3, 5, 6]


def test_ties_broken_by_lower_id_and_deterministic():
    freqs = torch.tensor([2, 2, 2, 2, 2, 2])
    assert build_vocab_map(freqs, 3).draft_ids.tolist() == [0, 1, 2]
    freqs = torch.tensor([1, 4, 4, 0, 4, 1])
    assert build_vocab_map(freqs, 2).draft_ids.tolist() == [1, 2]
    a, b = build_vocab_map(freqs, 4), build_vocab_map(freqs.clone(), 4)
    assert torch.equal(a.d2t, b.d2t) and a.draft_ids.tolist() == [0, 1, 2, 4]


def test_fewer_seen_tokens_than_draft_vocab_fills_lowest_unseen_ids():
    freqs = torch.zeros(10)
    freqs[7] = 3
    freqs[9] = 1
    vm = build_vocab_map(freqs, 4)
    assert vm.draft_ids.tolist() == [0, 1, 7, 9]
    assert int(vm.t2d.sum()) == 4


def test_full_vocab_has_no_map():
    assert build_vocab_map(torch.ones(8), 8) is None
    assert build_vocab_map(torch.ones(8), 100) is None


def test_vocab_imports_no_other_stage():
    code = (
        "import sys, eyas.heads.vocab; "
        "bad=[m for m in sys.modules if m.startswith(('eyas.data','eyas.train','eyas.eval'))]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
