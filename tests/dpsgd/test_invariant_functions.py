"""The invariant when the loop's loss is a plain function, not an ``nn`` module
(``dpsgd/loss_watch.py``, ``LossFunctions``): functional losses with class weights or ignored
positions are made exact per record like their modules, and a loss that couples records
through the model's outputs (InfoNCE, centred logits, a batch statistic) is refused at
``loss.backward()``, before anything is computed or released."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dpsgd.test_invariant import (
    ALL_MODES,
    TokenLM,
    W,
    assert_invariant,
    batch,
    lm_batch,
    lm_own,
    mlp,
    released,
)
from workbench.errors import LossCouplingError


def weighted(o, y):
    return F.cross_entropy(o, y, weight=W)


def weighted_own(o, y):
    return F.cross_entropy(o, y, weight=W, reduction="sum")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_functional_class_weights_are_per_record_exact(mode):
    x, y = batch()
    assert_invariant(mlp, weighted, weighted_own, x, y, mode)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("T", [3, 6])  # n = 6: T == n too
def test_functional_ignore_index_token_mean_is_per_record(T, mode):
    x, y = lm_batch(6, T)

    def loss(out, t):  # the Hugging Face way: a token mean over the whole batch
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1), ignore_index=-100)

    assert_invariant(lambda: TokenLM().double(), loss, lm_own, x, y, mode)


def info_nce(z, y):
    return F.cross_entropy(z @ z.T / 0.5, torch.arange(z.shape[0]))


def centred(z, y):
    return F.cross_entropy(z - z.mean(0), y)


def batch_stat(z, y):
    return F.cross_entropy(z, y) + z.mean(0).pow(2).sum()


def softmax_over_batch(z, y):
    return -(z.softmax(0)[torch.arange(z.shape[0]), y]).log().mean()


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "auto"])
@pytest.mark.parametrize("loss", [info_nce, centred, batch_stat, softmax_over_batch])
def test_plain_function_losses_coupling_records_are_refused(loss, mode):
    x, y = batch()
    with pytest.raises(LossCouplingError, match="depend on the other records' outputs"):
        released(mlp(), loss, x, y, mode)


def test_separable_plain_function_is_accepted_and_exact():
    def per_record(z, y):  # a hand-written per-record loss: squared margin, mean over records
        return (z.logsumexp(1) - z[torch.arange(z.shape[0]), y]).pow(2).mean()

    def own(z, y):
        return (z.logsumexp(1) - z[torch.arange(z.shape[0]), y]).pow(2).sum()

    x, y = batch()
    assert_invariant(mlp, per_record, own, x, y, "bookkeeping")


def test_the_window_leaves_no_function_mode_behind():
    x, y = batch()
    before = torch._C._len_torch_function_stack()
    released(mlp(), weighted, x, y, "einsum")
    assert torch._C._len_torch_function_stack() == before
    model = nn.Linear(3, 2)  # a later unrelated backward is not watched
    model(torch.randn(4, 3)).sum().backward()


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_a_functional_sum_divided_by_n_is_a_mean(mode):
    def summed_then_mean(o, y):  # the same loss as F.cross_entropy(o, y), written as a sum / n
        return F.cross_entropy(o, y, reduction="sum") / o.shape[0]

    def own(o, y):
        return F.cross_entropy(o, y, reduction="sum")

    x, y = batch()
    assert_invariant(mlp, summed_then_mean, own, x, y, mode)


def test_a_functional_mean_under_a_sum_reduction_is_refused():
    x, y = batch()
    with pytest.raises(ValueError, match="reduction='mean' but the DP optimizer has "
                                         "loss_reduction='sum'"):
        released(mlp(), lambda o, t: F.cross_entropy(o, t), x, y, "einsum", reduction="sum")
