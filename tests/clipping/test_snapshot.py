"""The clipping snapshot: Eq. (4)'s tables against the direct computation, and against numpy."""

import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.clipping import snapshot
from workbench.clipping.snapshot import (
    clip_at,
    clipping_snapshot,
    direct_clip_at,
    per_sample_snapshot,
)

RTOL = 1e-9  # float64 throughout; Eq. (4) only reorders the sums of Eq. (1)
FIELDS = ("fraction_clipped", "mean_norm", "clipped_mean_norm", "cosine")


def weighted_loss(outputs, targets):
    """Cross-entropy per sample times its weight; targets = (labels, weights), weight 0 gives
    a sample a zero gradient."""
    labels, weights = targets
    return nn.functional.cross_entropy(outputs, labels, reduction="none") * weights


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(40, 6, dtype=torch.float64)
    weights = torch.rand(40, dtype=torch.float64) * 3  # spread the norms out
    weights[7] = 0.0  # one sample with g_i = 0
    y, loss_fn = (torch.randint(0, 3, (40,)), weights), weighted_loss
    grads = wb.per_sample_gradients(model, loss_fn, x, y, method="microbatch")
    return model, loss_fn, x, y, grads, per_sample_snapshot(model, loss_fn, x, y)


def by_hand(grads, C):
    """fraction clipped and cos(m̃, m) with numpy from {name: (n, ...)}: Eq. (1)-(2)."""
    g = np.concatenate([v.flatten(1).numpy() for v in grads.values()], axis=1)  # (n, d)
    norms = np.linalg.norm(g, axis=1)  # (n,)
    c = np.minimum(1.0, C / np.where(norms > 0, norms, np.inf))  # (n,)
    m, mc = g.mean(0), (c[:, None] * g).mean(0)  # (d,)
    return np.mean(norms > C), m @ mc / np.linalg.norm(m) / np.linalg.norm(mc)


def test_clip_at_agrees_with_the_direct_computation(problem):
    *_, grads, snap = problem
    norms = snap.norms[snap.norms > 0]
    # C from below the smallest norm to above the largest, avoiding exact ties with a norm
    for C in np.geomspace(norms.min() / 3, norms.max() * 3, 41) * (1 + 1e-7):
        fast, slow = clip_at(snap, C), direct_clip_at(grads, C)
        for field in FIELDS:
            assert getattr(fast, field) == pytest.approx(getattr(slow, field), rel=RTOL), field
        np.testing.assert_allclose(fast.layer_cosine, slow.layer_cosine, rtol=RTOL)
        np.testing.assert_allclose(fast.clip_factors, slow.clip_factors, rtol=1e-12)
        fraction, cosine = by_hand(grads, C)
        assert fast.fraction_clipped == fraction
        assert fast.cosine == pytest.approx(cosine, rel=RTOL)


def test_fraction_clipped_counts_the_norms_above_C(problem):
    *_, snap = problem
    C = float(np.median(snap.norms)) * 1.0001
    r = clip_at(snap, C)
    assert r.fraction_clipped == sum(n > C for n in snap.norms.tolist()) / len(snap.norms)
    assert np.all(r.clip_factors[snap.norms > C] < 1)
    assert np.all(r.clip_factors[snap.norms <= C] == 1)
    assert r.cosine < 0.999  # clipping half the samples tilts the mean: a bias, not a rescaling


def test_huge_C_clips_nothing_and_has_no_bias(problem):
    *_, snap = problem
    r = clip_at(snap, 1e12)
    assert r.fraction_clipped == 0.0 and np.all(r.clip_factors == 1.0)
    assert r.cosine == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(r.layer_cosine, 1.0, atol=1e-12)
    assert r.clipped_mean_norm == pytest.approx(r.mean_norm, rel=1e-12)


def test_tiny_C_clips_every_nonzero_sample_to_norm_C(problem):
    *_, grads, snap = problem
    C = 1e-6
    r = clip_at(snap, C)
    assert r.fraction_clipped == 39 / 40  # all but the zero-gradient sample
    g = torch.cat([v.flatten(1) for v in grads.values()], 1)  # (n, d)
    u = g / g.norm(dim=1, keepdim=True).clamp(min=1e-300)  # (n, d) unit vectors, 0 for g = 0
    assert r.clipped_mean_norm == pytest.approx(C * u.mean(0).norm().item(), rel=RTOL)


def test_layer_norms_squares_add_up_to_the_total(problem):
    model, loss_fn, x, y, _, snap = problem
    assert snap.layers == ("0", "2") and snap.layer_norms.shape == (40, 2)
    np.testing.assert_allclose((snap.layer_norms**2).sum(1), snap.norms**2, rtol=1e-12)
    ghost = wb.per_sample_grad_norms(model, loss_fn, x, y, method="ghost")
    np.testing.assert_allclose(snap.norms, ghost.numpy(), rtol=1e-9)
    assert snap.norms[7] == 0.0 and np.isfinite(snap.tables).all()
    assert snap.num_params == sum(p.numel() for p in model.parameters())


def test_parameters_are_grouped_by_module_path():
    torch.manual_seed(0)
    nested = nn.Sequential()
    nested.add_module("features", nn.Sequential(nn.Linear(3, 4), nn.ReLU()))
    nested.add_module("head", nn.Linear(4, 2))
    x, y, ce = torch.randn(5, 3), torch.randint(0, 2, (5,)), nn.CrossEntropyLoss(reduction="none")
    assert per_sample_snapshot(nested, ce, x, y).layers == ("features.0", "head")
    assert per_sample_snapshot(nn.Linear(3, 2), ce, x, y).layers == (snapshot.ROOT,)


def test_the_block_size_does_not_change_the_tables(problem, monkeypatch):
    model, loss_fn, x, y, _, snap = problem
    monkeypatch.setattr(snapshot, "BLOCK", 50)  # one column per block
    small = per_sample_snapshot(model, loss_fn, x, y)
    np.testing.assert_allclose(small.tables, snap.tables, rtol=1e-12, atol=1e-12)


def test_clipping_snapshot_is_both_steps_and_leaves_the_model_alone(problem):
    model, loss_fn, x, y, _, snap = problem
    r = clipping_snapshot(model, loss_fn, x, y, 0.5)
    assert r.cosine == clip_at(snap, 0.5).cosine
    assert all(p.grad is None for p in model.parameters())


def test_bad_inputs_raise_errors_naming_the_argument(problem):
    model, loss_fn, x, y, _, snap = problem
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_grad_norm"):
            clip_at(snap, bad)
    with pytest.raises(ValueError, match="max_grad_norm"):
        clipping_snapshot(model, loss_fn, x, y, -1.0)
    frozen = nn.Linear(6, 3).double().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        per_sample_snapshot(frozen, loss_fn, x, y)
