"""Mixed precision (issue 29 item 4): DP-SGD under ``torch.autocast`` against a float64 twin.

The model trains in float32 under autocast (bfloat16, or float16 with a ``GradScaler``); its
twin is the same model in float64 without autocast, per-record gradients by micro-batching,
Σ_i clip_C(g_i). The engine computes norms, clip factors and the clipped sum in float32 from
widened activations and backprops (``per_sample/precision.py``), so:

- the bound c_i ||g_i|| ≤ C holds to float32 rounding, whatever the autocast dtype;
- the released sum differs from the twin's only by the forward and backward pass's rounding
  in the autocast dtype. bfloat16 keeps 8 significant bits (unit roundoff 2⁻⁹ ≈ 2e-3); a
  record's gradient passes ~5 rounded operations (two matmuls forward, two backward, the
  LayerNorm's output), so a few 1e-3 relative, and a clip factor inherits its norm's error:
  TOL_SUM[bf16] = 3e-2 of ||twin||, measured 0.3-1e-2. float16 keeps 11 bits (2⁻¹²
  ≈ 2.4e-4): TOL_SUM[fp16] = 5e-3, measured ~1e-3. A wrong row, a mixed batch or a scale left
  in is off by O(1) (a GradScaler's 2¹⁶ by 6e4).
"""

import copy

import pytest
import torch
from torch import nn

from workbench.clipping import clipped_grad_sum
from workbench.dpsgd.optimizer import MODES, DPOptimizer
from workbench.errors import PerSampleCheckError, SampleMixingError, UnsupportedLayerError

ALL_MODES = (*MODES, "auto")
C, N, D, K = 0.3, 6, 5, 4  # clip norm (most records are clipped), batch, features, classes
TOL_SUM = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative to ||twin||: docstring
AMP = (torch.bfloat16, torch.float16)
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # relative rounding step


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, K))


def batch(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


def step(model, x, y, mode, amp, loss=None, verify=True):
    """One DP step with σ = 0, B = 1, lr = 0 under autocast(amp); float16 with a GradScaler.
    Returns (the released Σ_i c_i g_i flattened, the optimizer's ``last``)."""
    loss = loss or nn.CrossEntropyLoss()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode)
    opt.verify = verify
    try:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=amp):
            value = loss(model(x), y)
        if amp == torch.float16:
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(value).backward()
            scaler.step(opt)
            scaler.update()
        else:
            value.backward()
            opt.step()
        assert all(p.grad.dtype == p.dtype for p in model.parameters())  # released in θ's
        return torch.cat([p.grad.flatten() for p in model.parameters()]), opt.last
    finally:
        opt.detach()


def twin(model, x, y, loss=None, gain=1.0):
    """(Σ_i clip_C(g_i), ||g_i|| (n,)) of the float64 copy without autocast, record by record
    (``gain``: its output times this)."""
    model = copy.deepcopy(model).double()
    loss = loss or nn.CrossEntropyLoss()
    params = list(model.parameters())
    total, norms = 0, []
    for i in range(x.shape[0]):
        xi = x[i:i + 1].double() if x.is_floating_point() else x[i:i + 1]
        g = torch.autograd.grad(loss(gain * model(xi), y[i:i + 1]), params)
        g = torch.cat([t.flatten() for t in g])
        norms.append(float(g.norm()))
        total = total + min(1.0, C / norms[-1]) * g
    return total, torch.tensor(norms, dtype=torch.float64)


def assert_matches_twin(got, last, ref, ref_norms, amp):
    tol = TOL_SUM[amp]
    assert float((got.double() - ref).norm()) <= tol * float(ref.norm())
    norms, c = last["norms"], last["clip_factors"]
    assert norms.dtype == torch.float64 and c.dtype in (torch.float32, torch.float64)
    assert float((c.double() * norms).max()) <= C * (1 + 1e-6)  # the bound, float32 rounding
    assert torch.allclose(norms, ref_norms, rtol=tol)


def conv(seed=0):  # Conv1d computes in the autocast dtype, book-keeping re-runs it
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(1, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(3 * (D - 1), K))


def embedding(seed=0):  # Embedding stays float32 under autocast; the Linear after it does not
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(3 * D, K))


MODELS = {"mlp": (mlp, lambda x: x), "conv": (conv, lambda x: x.unsqueeze(1)),
          "embedding": (embedding, lambda x: (x.abs() * 3).long().clamp(max=6))}


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_autocast_step_matches_the_float64_twin(kind, mode, amp):
    make, inputs = MODELS[kind]
    x, y = batch()
    x = inputs(x)
    model = make()
    got, last = step(model, x, y, mode, amp)
    assert_matches_twin(got, last, *twin(model, x, y), amp)


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_removing_one_record_moves_the_sum_by_at_most_C(kind, mode, amp):
    make, inputs = MODELS[kind]
    x, y = batch()
    x = inputs(x)
    got, _ = step(make(), x, y, mode, amp)
    for j in (0, N - 1):
        keep = torch.arange(N) != j
        other, _ = step(make(), x[keep], y[keep], mode, amp)
        # record j's own contribution is ≤ C (checked against the twin above); the others'
        # move by their rounding in the autocast dtype, which depends on the batch (b_i is
        # rounded after the mean's 1/n: measured 1.2e-3 C in total for the Conv1d model), at
        # most ~2 u per record (precision.py)
        assert float((got - other).double().norm()) <= C * (1 + (N - 1) * 2 * UNIT[amp])


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, K))


class Doubled(nn.Module):
    """Doubles its output only under autocast, outside any layer: the self-check's twins must
    run the model under the recorded autocast state, or they see a model half as steep."""

    def __init__(self, dropout=0.0, outside=False):
        super().__init__()
        self.body, self.drop = mlp(), nn.Dropout(dropout)
        self.scale = Gain() if outside else None  # read outside its own forward: fallback

    def forward(self, x):
        out = self.body(self.drop(x) if self.drop.p else x)
        if self.scale is not None:
            out = out * self.scale.gain  # the whole-model fallback's parameter
        return out * 2 if torch.is_autocast_enabled("cpu") else out


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("kind", ["probe", "record probe", "fallback"])
def test_the_self_check_replays_the_recorded_autocast_state(kind, amp):
    x, y = batch()
    torch.manual_seed(3)
    model = Doubled(dropout=0.2 if kind == "record probe" else 0.0, outside=kind == "fallback")
    step(model, x, y, "bookkeeping", amp, verify="always")  # raises if it ran without autocast
    if kind == "fallback":  # the fallback's gain also equals the twin's (run under autocast)
        got, last = step(model, x, y, "einsum", amp, verify="always")
        assert_matches_twin(got, last, *twin(model, x, y, gain=2.0), amp)  # 2: autocast's


class Centred(nn.Module):
    """x - x.mean(0) outside any module: records mix (the self-check must catch it)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.fc, self.head, self.drop = nn.Linear(D, 8), nn.Linear(8, K), nn.Dropout(dropout)

    def forward(self, x):
        h = self.drop(self.fc(x))
        return self.head(h - h.mean(0))


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_self_check_catches_a_mixing_model_under_autocast(dropout, amp):
    x, y = batch()
    torch.manual_seed(0)
    with pytest.raises((PerSampleCheckError, SampleMixingError)):
        step(Centred(dropout), x, y, "einsum", amp, verify="always")


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("method", ["microbatch", "einsum", "ghost", "bookkeeping"])
def test_the_functional_api_inside_an_autocast_block(method, amp):
    x, y = batch()
    model = mlp()
    with torch.autocast("cpu", dtype=amp):
        sums = clipped_grad_sum(model, nn.CrossEntropyLoss(reduction="none"), x, y, C,
                                method=method, check="always")
    got = torch.cat([sums[k].flatten() for k, _ in model.named_parameters()])
    assert all(s.dtype == torch.float32 for s in sums.values())
    ref, _ = twin(model, x, y)
    assert float((got.double() - ref).norm()) <= TOL_SUM[amp] * float(ref.norm())


def test_vmap_of_the_whole_model_under_autocast_works_or_says_why():
    x, y = batch()
    loss = nn.CrossEntropyLoss(reduction="none")
    plain = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, K))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums = clipped_grad_sum(plain, loss, x, y, C, method="vmap")
        ref = clipped_grad_sum(plain, loss, x, y, C, method="microbatch")
        for k in ref:  # both in bfloat16 (batched and one by one): its rounding apart
            assert float((sums[k] - ref[k]).norm()) <= TOL_SUM[torch.bfloat16] * float(
                ref[k].norm())
        with pytest.raises(UnsupportedLayerError, match="autocast.*einsum"):
            clipped_grad_sum(mlp(), loss, x, y, C, method="vmap")  # LayerNorm on bfloat16


def test_a_grad_scaler_overflowing_every_record_lowers_its_scale_and_goes_on():
    """At a scale past float16's range every record's gradient is inf: the step releases
    noise alone (each record's term 0, within C), warns, and scaler.update() halves the
    scale until records come through (a probe, 2026-11-30: NonFiniteGradientError ended the
    run at the scaler's first overflow)."""
    import warnings

    from workbench.clipping.nonfinite import NonFiniteRecordWarning

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=6, loss_reduction="sum")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    dropped = []
    for _ in range(12):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y).sum()
        scaler.scale(loss).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
        scaler.update()
        dropped.append(opt.last["nonfinite"])
        if opt.last["nonfinite"]:
            assert any(issubclass(w.category, NonFiniteRecordWarning)
                       and "GradScaler" in str(w.message) for w in caught)
    assert dropped[0] == 6 and dropped[-1] == 0  # every record at 2^24; none once lowered
    assert scaler.get_scale() < 2.0 ** 24
