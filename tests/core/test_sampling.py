import torch

from eyas.core.sampling import sample_tokens


def test_greedy_and_nucleus_sampling():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    assert sample_tokens(logits[:3], 0.0).tolist() == [0, 0, 0]
    g = torch.Generator().manual_seed(0)
    # top_p 0.7: the nucleus is {0, 1} (0.5 < 0.7 <= 0.8); the two tail tokens never come out
    drawn = sample_tokens(logits, 1.0, top_p=0.7, generator=g)
    counts = torch.bincount(drawn, minlength=4)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.05
    # top_p 1: every token, at its own probability
    counts = torch.bincount(sample_tokens(logits, 1.0, generator=g), minlength=4)
    assert counts[3] > 0 and abs(counts[0] / 2000 - 0.5) < 0.05
    # a tiny top_p keeps only the top token
    assert sample_tokens(logits[:50], 1.0, top_p=0.01, generator=g).eq(0).all()


def test_greedy_on_bf16_logits_matches_float32_argmax_with_ties():
    # regeneration hands bf16 logits [B, 49152]; ties are common at bf16 precision and the
    # first maximal index must win, as float32 argmax picks it
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=g) * 4).round().bfloat16()
    logits[0, 100] = logits[0, 49000] = 99.0  # a tie across blocks
    got = sample_tokens(logits, 0.0)
    assert torch.equal(got, logits.float().argmax(-1))
    assert int(got[0]) == 100
