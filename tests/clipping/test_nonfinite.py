"""Non-finite and extreme records: never poison a sum, never vanish from it silently.

Each bad record (NaN input, inf target, inf in the loss) is checked in every optimizer mode and
in the functional API, float32 and float64; a 1e20-scale float32 gradient is clipped to norm C.
The twin is the sum over the good records alone, clipped by micro-batching.
"""

import warnings

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import relative_error
from workbench.clipping import CLIP_METHODS, NORM_METHODS
from workbench.clipping.flat import many_sample_squares, sample_norms, sample_squares
from workbench.clipping.nonfinite import NonFiniteRecordWarning
from workbench.dpsgd import MODES, DPOptimizer
from workbench.errors import NonFiniteGradientError

DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}
BAD = 3  # the index of the bad record (n = 6)


def model_of(dtype, norm_layer=True):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), nn.Tanh()] + ([nn.LayerNorm(5)] if norm_layer else [])
    return nn.Sequential(*layers, nn.Linear(5, 2)).to(dtype)


def mse(out, y):
    return (out - y).pow(2).sum(1)  # (n,)


def log_loss(out, y):  # log(0) = -inf for a record whose y[:, 1] is 0: an inf loss
    return (out - y).pow(2).sum(1) + out[:, 0] * torch.log(y[:, 1].abs())


def batch(dtype, kind, last=False):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g, dtype=dtype), torch.randn(6, 2, generator=g,
                                                                     dtype=dtype)
    i = 5 if last else BAD
    loss = mse
    if kind == "nan_input":
        x[i, 1] = float("nan")
    elif kind == "inf_target":
        y[i, 0] = float("inf")
    elif kind == "inf_loss":
        loss = log_loss
        y[i, 1] = 0.0  # finite; the loss itself is inf for record i
    return x, y, loss, i


def setup(dtype, kind, last=False):
    x, y, loss, i = batch(dtype, kind, last)
    return model_of(dtype), x, y, loss, i


def good_twin(model, loss, x, y, i, C):
    keep = [k for k in range(x.shape[0]) if k != i]
    return wb.clipped_grad_sum(model, loss, x[keep], y[keep], C, method="microbatch")


KINDS = ("nan_input", "inf_target", "inf_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_optimizer_skips_and_counts_a_nonfinite_record(mode, kind, dtype):
    model, x, y, loss, i = setup(dtype, kind, last=mode == "einsum")  # last: the probed one
    assert not torch.isfinite(loss(model(x), y)[i]) and torch.isfinite(x).all() or \
        kind != "inf_loss"  # the loss itself is inf, from finite inputs
    C, B = 0.5, 6.0
    expected = good_twin(model, loss, x, y, i, C)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=B, method=mode,
                      loss_reduction="sum")
    opt.zero_grad()
    loss(model(x), y).sum().backward()
    with pytest.warns(NonFiniteRecordWarning, match=rf"1 of 6 records .*indices {i}\)"):
        opt.step()
    assert opt.last["nonfinite"] == 1 and opt.last["nonfinite_indices"] == [i]
    assert opt.last["clip_factors"][i] == 0
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), (mode, name)
        assert relative_error(p.grad * B, expected[name]) <= RTOL[dtype], (mode, name)
    opt.detach()


class TwoBranches(nn.Module):
    """out = [a(x[:, :2]), b(x[:, 2:])]: an inf target on b's output leaves a's gradient finite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)

    def forward(self, x):
        return torch.cat([self.a(x[:, :2]), self.b(x[:, 2:])], dim=1)


def per_layer_step(model, mode, x, y):
    groups = [{"params": model.a.parameters()}, {"params": model.b.parameters()}]
    opt = DPOptimizer(torch.optim.SGD(groups, lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=[0.3, 0.4], expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.zero_grad()
    mse(model(x), y).sum().backward()
    opt.step()
    opt.detach()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, opt.last


@pytest.mark.parametrize("mode", MODES)
def test_per_layer_clipping_zeroes_the_record_in_every_group(mode):
    model = TwoBranches().double()
    x, y, _, i = batch(torch.float64, "inf_target")  # y[i, 0]: a's output... make it b's:
    y[i, 0], y[i, 1] = 0.0, float("inf")  # only b's gradient is non-finite for record i
    keep = [k for k in range(6) if k != i]
    expected, _ = per_layer_step(model, "microbatch", x[keep], y[keep])
    with pytest.warns(NonFiniteRecordWarning):
        grads, last = per_layer_step(model, mode, x, y)
    assert last["nonfinite_indices"] == [i]
    for name, g in grads.items():  # a's part of record i is finite, and left out too
        assert relative_error(g, expected[name]) <= 1e-12, (mode, name)


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_of_nonfinite_records_is_refused_before_any_change(mode):
    model = model_of(torch.float64)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")  # NaN parameters: every record is NaN
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=6.0, method=mode)
    x, y, loss, _ = batch(torch.float64, "none")
    opt.zero_grad()
    loss(model(x), y).mean().backward()
    with pytest.raises(NonFiniteGradientError, match="every one of the 6 records"):
        opt.step()
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) or v.isnan().any() for k, v in before.items())
    opt.detach()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", CLIP_METHODS)
def test_functional_clipped_sum_names_the_record(method, kind, dtype):
    model, x, y, loss, i = setup(dtype, kind)
    with pytest.raises(NonFiniteGradientError, match=rf"record\(s\) {i} of the batch hold NaN"):
        wb.clipped_grad_sum(model, loss, x, y, 1.0, method=method)


@pytest.mark.parametrize("method", NORM_METHODS)
def test_functional_norms_report_the_nonfinite_record(method):
    model, x, y, loss, i = setup(torch.float32, "nan_input")
    norms = wb.per_sample_grad_norms(model, loss, x, y, method=method)
    assert torch.isfinite(norms).tolist() == [k != i for k in range(6)]


def huge(dtype, scale=1e10):
    """A record whose per-sample gradient is ~scale² (1e20): a ~scale input times a ~scale
    backprop. Two Linear layers (no LayerNorm, which would undo the scale)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 4, generator=g, dtype=dtype), torch.ones(6, 2, dtype=dtype)
    x[BAD] *= scale
    w[BAD] *= scale
    return model, x, w, lambda out, w: (out * w).sum(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_norms_do_not_overflow(dtype):
    g = torch.full((3, 1000), 1e18, dtype=dtype)  # ||g_i|| = 3.2e19: ||g_i||² > float32 max
    g[1] = 1.0
    g[2, 7] = float("inf")
    norms = sample_norms(g)
    assert norms.dtype == torch.float64
    assert norms[0] == pytest.approx(1e18 * 1000 ** 0.5, rel=1e-6)
    assert norms[1] == pytest.approx(1000 ** 0.5) and not torch.isfinite(norms[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", CLIP_METHODS)
def test_a_huge_finite_gradient_is_clipped_to_C_not_dropped(method, dtype):
    model, x, w, loss = huge(dtype)
    ref = wb.per_sample_grad_norms(model, loss, x.double(), w.double(), method="microbatch") \
        if dtype == torch.float64 else None
    norms = wb.per_sample_grad_norms(model, loss, x, w, method="microbatch")
    assert 1e19 < norms[BAD] < 1e22 and torch.isfinite(norms).all()
    if ref is not None:
        assert relative_error(norms, ref) <= 1e-12
    C = 1.0
    alone = wb.clipped_grad_sum(model, loss, x[BAD:BAD + 1], w[BAD:BAD + 1], C, method=method)
    assert float(sum(g.double().pow(2).sum() for g in alone.values())) ** 0.5 == \
        pytest.approx(C, rel=RTOL[dtype])  # the record alone, clipped to exactly C
    full = wb.clipped_grad_sum(model, loss, x, w, C, method=method)
    rest = [k for k in range(6) if k != BAD]
    others = wb.clipped_grad_sum(model, loss, x[rest], w[rest], C, method="microbatch")
    for name, g in full.items():  # = the other records' sum + the huge one's, clipped to C
        assert relative_error(g, others[name] + alone[name]) <= 10 * RTOL[dtype], name


@pytest.mark.parametrize("method", NORM_METHODS)
def test_every_norm_method_agrees_on_a_huge_float32_gradient(method):
    model, x, w, loss = huge(torch.float32)
    ref = wb.per_sample_grad_norms(model.double(), loss, x.double(), w.double(),
                                   method="microbatch")
    model.float()
    norms = wb.per_sample_grad_norms(model, loss, x, w, method=method)
    assert norms.dtype == torch.float32 and torch.isfinite(norms).all()
    assert relative_error(norms.double(), ref) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_optimizer_clips_a_huge_gradient_to_C(mode, dtype):
    model, x, w, loss = huge(dtype)
    C = 1.0
    expected = wb.clipped_grad_sum(model, loss, x, w, C, method="microbatch")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.zero_grad()
    loss(model(x), w).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteRecordWarning)
        opt.step()
    assert opt.last["nonfinite"] == 0 and 0 < opt.last["clip_factors"][BAD] < 1e-18
    for name, p in model.named_parameters():
        assert relative_error(p.grad, expected[name]) <= 10 * RTOL[dtype], (mode, name)
    opt.detach()


class ParentReadsChild(nn.Module):
    """``lin.bias`` is also read outside ``lin``: its per-sample gradient comes from the exact
    whole-model fallback, the path of the parameters no per-layer rule accounts for."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(h) + h[:, :2] * self.lin.bias[:2]


@pytest.mark.parametrize("mode", MODES)
def test_a_nonfinite_record_in_the_exact_fallback_is_masked(mode):
    model = ParentReadsChild().double()
    x, y, loss, i = batch(torch.float64, "nan_input")
    expected = good_twin(model, loss, x, y, i, 0.5)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.zero_grad()
    loss(model(x), y).sum().backward()
    with pytest.warns(NonFiniteRecordWarning):
        opt.step()
    for name, p in model.named_parameters():
        assert relative_error(p.grad, expected[name]) <= 1e-9, (mode, name)
    opt.detach()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("overflow", [False, True])
def test_many_sample_squares_are_sample_squares_bit_for_bit(dtype, overflow):
    """One overflow test for all tensors: the same values as one sample_squares each, also
    when one tensor overflows (it alone is rescaled) and beside a 1-d (bias-like) tensor."""
    g = torch.Generator().manual_seed(4)
    gs = [torch.randn(3, 5, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype),
          torch.randn(3, 2, 4, generator=g).to(dtype)]
    if overflow:
        gs[2][1] = 1e18 if dtype != torch.float16 else 6e4
    got = many_sample_squares(gs)
    for a, b in zip(got, [sample_squares(t) for t in gs]):
        assert a.dtype == torch.float64 and torch.equal(a, b)
    assert torch.isfinite(torch.stack(got)).all()
