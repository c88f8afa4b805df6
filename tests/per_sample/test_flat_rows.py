"""Position-wise layers on batch-flattened rows (``per_sample/flat_rows.py``): OPT's MLP on
``h.reshape(-1, d)``. Sample-major rows take the layer's rule, exact against micro-batching
(float64) in every method and optimizer mode; rows of unproven layout (time-major, reordered,
two batches concatenated) keep the exact fallback, also at n = T."""

import pytest
import torch
from torch import nn

from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    assert_optimizer_matches_microbatch,
    exact_routes,
    mse_per_sample,
)
from workbench.dpsgd import MODES
from workbench.per_sample.flat_rows import FlatRows, merged
from workbench.rules.affine import row_wise

T, D = 3, 4


class ScaledRMSNorm(nn.Module):
    """A hand-written RMSNorm (no rule by type: the affine behaviour rule)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class FlatMLP(nn.Module):
    """OPT's decoder MLP: (n, T, d) -> (n·T, d) rows -> norm, fc1, ReLU, fc2, residual -> back.
    ``layout``: how the rows are made (only "sample" is provably sample-major)."""

    def __init__(self, layout="sample"):
        super().__init__()
        self.layout = layout
        self.norm, self.rms = nn.LayerNorm(D), ScaledRMSNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 6), nn.Linear(6, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x):  # (n, T, d)
        n = x.shape[0]
        if self.layout == "time":  # time-major rows: row r is sample r mod n
            h = x.transpose(0, 1).reshape(-1, D)
        elif self.layout == "cat":  # two batches stacked: 2n·T rows
            h = torch.cat([x, 2 * x]).reshape(-1, D)
        else:
            h = x.reshape(-1, D)
        if self.layout == "flip":  # rows reordered before the layers, restored after
            h = h.flip(0)
        elif self.layout == "copy":  # the same, written in place into tagged rows
            h = h.clone()
            h.copy_(h.flip(0))
        o = self.fc2(torch.relu(self.fc1(self.rms(self.norm(h))))) + h  # (rows, d)
        if self.layout in ("flip", "copy"):
            o = o.flip(0)
        if self.layout == "time":
            o = o.reshape(-1, n, D).transpose(0, 1)
        elif self.layout == "cat":
            o = o.reshape(2, n, -1, D).sum(0)
        return self.head(o.reshape(n, -1, D))  # (n, T, 2)


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, T, D, generator=g, dtype=torch.float64),
            torch.randn(n, T, 2, generator=g, dtype=torch.float64))


def model(layout="sample"):
    torch.manual_seed(0)
    return FlatMLP(layout).double()


FLAT = {"norm", "rms", "fc1", "fc2"}  # the layers called on (rows, d)


@pytest.mark.parametrize("n", [2, T])  # n = T: a layout shapes cannot tell apart
def test_sample_major_rows_take_their_rules_exactly(n):
    routes = exact_routes(model(), *batch(n))
    flat = routes[routes["layer"].isin(FLAT)]
    assert len(flat) == len(FLAT), routes
    assert not flat["route"].str.contains("fallback|vmap").any(), flat


@pytest.mark.parametrize("layout", ["time", "flip", "copy", "cat"])
@pytest.mark.parametrize("n", [2, T])
def test_rows_of_unproven_layout_keep_the_exact_fallback(layout, n):
    routes = exact_routes(model(layout), *batch(n))
    flat = routes[routes["layer"].isin(FLAT)]
    assert (flat["route"] == "exact fallback").all(), flat


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize("layout", ["sample", "time"])
def test_optimizer_on_flattened_rows_matches_microbatching(mode, layout):
    sizes = ((0, 2), (1, T), (2, 5))  # n = T in the middle: a new signature, probed again
    batches = [batch(n, seed) for seed, n in sizes]
    assert_optimizer_matches_microbatch(model(layout), mse_per_sample, batches, method=mode)


@pytest.mark.parametrize("layout", ["sample", "time", "flip", "cat"])
def test_unchecked_calls_are_exact_too(layout):
    """n = T without the self-check: time-major rows flattened gave a tag (T, n) read as
    (n, T), silently wrong by 180% before the rows' dim 0 had to be proved the batch's."""
    m, (x, y) = model(layout), batch(T)
    assert_agree(m, mse_per_sample, x, y, check=False)
    assert_clipping_agrees(m, mse_per_sample, x, y)


def test_merged_reads_only_a_merge_of_leading_dims():
    assert merged(torch.Size([2, 3, 4]), torch.Size([6, 4])) == 2
    assert merged(torch.Size([12, 4]), torch.Size([6, 2, 4])) is None  # a split: _reshaped
    assert merged(torch.Size([2, 3, 4]), torch.Size([2, 12])) == 1
    assert merged(torch.Size([2, 3, 4]), torch.Size([4, 6])) is None  # not a merge


def test_tags_follow_reshapes_and_elementwise_ops_only():
    rows, x = FlatRows(), torch.randn(2, 3, 4)
    unseen = x.reshape(-1, 4)  # x not seeded: its dim 0 not known to be the batch
    rows.after("reshape", (x, -1, 4), {}, unseen)
    assert rows.of(unseen) is None
    rows.seed([x])  # a model input: the batch on dim 0, one row each
    assert rows.of(x) == (2, 1)
    h = x.reshape(-1, 4)
    rows.after("reshape", (x, -1, 4), {}, h)
    assert rows.of(h) == (2, 3)
    r = torch.relu(h)
    rows.after("relu", (h,), {}, r)
    assert rows.of(r) == (2, 3)
    f = h.flip(0)  # not followed: reordered rows carry no tag
    assert rows.of(f) is None
    s = h + f  # tagged rows meet rows of unknown order: no proof
    rows.after("__add__", (h, f), {}, s)
    assert rows.of(s) is None
    b = h + torch.ones(4)  # a broadcast bias carries no rows
    rows.after("__add__", (h, torch.ones(4)), {}, b)
    assert rows.of(b) == (2, 3)
    one = torch.randn(1, 4)  # an input of one row (position ids' embedding): broadcast
    rows.seed([one])
    p = h + one
    rows.after("__add__", (h, one), {}, p)
    assert rows.of(p) == (2, 3)
    split = h.reshape(2, 3, 4)  # back to the batch: dim 0 split into the samples
    rows.after("reshape", (h, 2, 3, 4), {}, split)
    assert rows.of(split) == (2, 1)
    odd = h.reshape(3, 2, 4)  # dim 0 split otherwise: no proof
    rows.after("reshape", (h, 3, 2, 4), {}, odd)
    assert rows.of(odd) is None
    moved = x.transpose(0, 1)  # time-major: dim 0 is no longer the batch
    rows.after("transpose", (x, 0, 1), {}, moved)
    flat = moved.reshape(-1, 4)
    rows.after("reshape", (moved, -1, 4), {}, flat)
    assert rows.of(moved) is None and rows.of(flat) is None
    heads = h.reshape(6, 2, 2)  # dim 0 kept whole: still rows
    rows.after("reshape", (h, 6, 2, 2), {}, heads)
    assert rows.of(heads) == (2, 3)
    r.relu_()  # an elementwise op in place keeps the proof
    rows.after("relu_", (r,), {}, r)
    assert rows.of(r) == (2, 3)
    h.copy_(f)  # rows written in place from rows of unknown order: every tag on h's storage
    rows.after("copy_", (h, f), {}, h)
    assert rows.of(h) is None and rows.of(heads) is None and rows.of(r) == (2, 3)


class WholeNorm(nn.Module):
    """o = w ⊙ a / ||a||: affine in w, but every row depends on every other."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x / x.norm()


def test_affine_rows_only_where_each_row_stands_alone():
    assert row_wise(ScaledRMSNorm(4).double())
    assert not row_wise(WholeNorm(4).double())


class DoubledLinear(nn.Linear):
    """A Linear subclass whose forward differs: it inherits no rule, flattened rows or not."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_a_subclass_changing_forward_inherits_no_row_rule():
    m = model()
    m.fc1 = DoubledLinear(D, 6).double()
    routes = exact_routes(m, *batch(2))
    by_layer = dict(zip(routes["layer"], routes["route"]))
    assert "fc1" not in by_layer, routes  # no rule of its own: the module's call is not
    # the Linear rule's; the F.linear op inside it is, on rows its input's proof covers, so it
    # is recorded as a Linear call inside its owner (tied.rule_less_owner), which hands its
    # parameters over; the 2 * after the op is in the op's backprops
    route = by_layer["F.linear(fc1.weight, fc1.bias) in its owner"]
    assert "vmap" not in route and "fallback" not in route, routes
    # fc1's own ops (linear, then 2 *) keep the rows: the proof goes on through them to fc2
    assert "fallback" not in by_layer["fc2"] and "vmap" not in by_layer["fc2"], routes
    before = routes[routes["layer"].isin({"norm", "rms"})]
    assert not before["route"].str.contains("fallback|vmap").any(), before
    x, y = batch(T)  # n = T without the self-check: each sample's rows, exactly
    assert_agree(m, mse_per_sample, x, y, check=False)
    assert_clipping_agrees(m, mse_per_sample, x, y)


def test_tags_follow_row_splits_topk_repeats_and_gathers():
    """A Mixture-of-Experts block's ops on flattened tokens (``test_moe_rows.py``): a reshape
    grouping j whole rows of one sample (j | T), ``topk`` along another dim, a repeat of each
    row along dim 0, a table gathered by a tagged index; a group that straddles samples, or a
    repeat along dim 0 without ``dim``, gives no tag."""
    table = torch.randn(5, 3, 4)  # computed without the batch (the taint's verdict)
    rows, x = FlatRows(lambda t: t is not table), torch.randn(2, 6, 4)
    rows.seed([x])
    flat = x.reshape(-1, 4)  # (12, 4): (2, 6)
    rows.after("reshape", (x, -1, 4), {}, flat)
    pairs = flat.view(6, 2, 4)  # two rows of one sample each: (2, 3)
    rows.after("view", (flat, 6, 2, 4), {}, pairs)
    assert rows.of(pairs) == (2, 3)
    fours = flat.view(3, 4, 4)  # rows 4..7 straddle samples 0 and 1: no proof
    rows.after("view", (flat, 3, 4, 4), {}, fours)
    assert rows.of(fours) is None
    top = torch.topk(flat, 2, dim=-1)
    rows.after("topk", (flat, 2), {"dim": -1}, top)
    assert rows.of(top.values) == rows.of(top.indices) == (2, 6)
    along0 = torch.topk(flat, 2, dim=0)
    rows.after("topk", (flat, 2), {"dim": 0}, along0)
    assert rows.of(along0.values) is None
    rep = flat.repeat_interleave(2, dim=0)  # row j is row j // 2: (2, 12)
    rows.after("repeat_interleave", (flat, 2), {"dim": 0}, rep)
    assert rows.of(rep) == (2, 12)
    whole = flat.repeat_interleave(2)  # no dim: flattened first, no rows
    rows.after("repeat_interleave", (flat, 2), {}, whole)
    assert rows.of(whole) is None
    wave = torch.sin(flat)  # a pointwise op (was not listed: the tag was lost, the fallback)
    rows.after("sin", (flat,), {}, wave)
    assert rows.of(wave) == (2, 6)
    ids = top.indices.reshape(-1)
    rows.after("reshape", (top.indices, -1), {}, ids)
    picked = table[ids]  # row r: the table's row ids[r]
    rows.after("__getitem__", (table, ids), {}, picked)
    assert rows.of(ids) == rows.of(picked) == (2, 12)
