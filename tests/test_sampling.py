import torch

from eyas.sampling import sample_tokens


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
