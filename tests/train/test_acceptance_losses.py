"""`train.loss`: the total variation the trainer minimises is 1 - the acceptance rate that
eyas's own speculative sampling realises, and the recipe key is typed and fingerprinted."""

import pytest
import torch

from eyas.eval.speculate import rejection_sample
from eyas.recipe import RecipeError, recipe_from_dict
from eyas.train.losses import lk_lambda, loss_rows, loss_terms_rows


def test_total_variation_is_one_minus_the_acceptance_rate_of_speculative_sampling():
    """For each of a few draft / target distribution pairs, draw the draft token from q and
    run `rejection_sample` (the evaluator's lossless rule) many times: the share accepted
    is 1 - tv within sampling error."""
    gen = torch.Generator().manual_seed(0)
    v, draws = 12, 5_000
    z = torch.randn(4, v, generator=gen, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(4, v, generator=gen, dtype=torch.float64) * 2, -1)
    _, tv, _ = loss_terms_rows(z, p, "tv")
    q = torch.softmax(z, -1)
    for row in range(4):
        drafts = torch.multinomial(q[row], draws, replacement=True, generator=gen)
        accepted = sum(
            rejection_sample(p[row : row + 1].expand(2, v), q[row : row + 1], drafts[i : i + 1], gen)[0]
            for i in range(draws)
        )
        rate = accepted / draws
        sigma = (rate * (1 - rate) / draws) ** 0.5
        assert abs((1 - float(tv[row])) - rate) < 5 * sigma + 1e-3, (row, float(tv[row]), rate)
    # the rows are far from each other: the check tells distributions apart
    assert float(tv.max() - tv.min()) > 0.1


def test_lk_weight_is_one_per_group_and_ignores_uncounted_rows():
    tv = torch.tensor([0.2, 0.4, 0.9, 0.0, 0.5])
    group = torch.tensor([0, 0, 1, -1, 1])
    lam = lk_lambda(tv, group, eta=2.0)
    a0, a1 = 1 - (0.2 + 0.4) / 2, 1 - (0.9 + 0.5) / 2
    expected = torch.exp(-2.0 * torch.tensor([a0, a0, a1, a0, a1], dtype=torch.float64)).float()
    torch.testing.assert_close(lam, expected)
    ce = torch.ones(5)
    torch.testing.assert_close(loss_rows("lk", ce, tv, group, 2.0), lam + (1 - lam) * tv)
    assert torch.equal(loss_rows("kl", ce, None, group, 2.0), ce)
    # eta 0 is pure KL; a large eta at full acceptance leaves almost only the TV
    torch.testing.assert_close(loss_rows("lk", ce, tv, group, 0.0), ce)


def test_loss_key_is_typed_and_old_runs_keep_their_fingerprint():
    from eyas.train.run_settings import training_settings

    with pytest.raises(RecipeError, match="train.loss"):
        recipe_from_dict({"train": {"loss": "js"}})
    base = training_settings(recipe_from_dict({}), "d")
    # a run recorded before the key existed trained with kl: its settings still match
    assert "train.loss" not in base and "train.lk_eta" not in base
    lk = training_settings(recipe_from_dict({"train": {"loss": "lk"}}), "d")
    assert lk["train.loss"] == "lk"


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_cross_entropy_and_tv_kernels_match_autograd(compile_mode):
    """The shared hand-written backward of the cross-entropy and the total variation (run
    eagerly and, as `train.compile_loss` auto does on large CPU rows, through
    torch.compile) equals autograd's gradient of their definitions, with both terms
    weighted as the LK blend weighs them."""
    from eyas.train import losses

    torch.manual_seed(5)
    z = 3 * torch.randn(6, 256)
    p = torch.softmax(2 * torch.randn(6, 256, dtype=torch.float64), -1).float()
    w_ce, w_tv = torch.rand(6), torch.rand(6)
    mine = z.clone().requires_grad_()
    ce, tv, top = loss_terms_rows(mine, p, "lk", compile_mode)
    assert not losses._compile_failed, losses._compile_failed
    (ce * w_ce + tv * w_tv).sum().backward()
    ref = z.clone().requires_grad_()
    q = torch.softmax(ref, -1)
    ref_ce = -(p * torch.log_softmax(ref, -1)).sum(-1)
    ref_tv = 0.5 * (p - q).abs().sum(-1)
    (ref_ce * w_ce + ref_tv * w_tv).sum().backward()
    torch.testing.assert_close(ce, ref_ce.detach())
    torch.testing.assert_close(tv, ref_tv.detach())
    torch.testing.assert_close(mine.grad, ref.grad)
    assert torch.equal(top, z.argmax(-1))
