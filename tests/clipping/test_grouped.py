"""clipping/grouped.py: per-sample gradients written into one buffer per group, against the
per-parameter twin (``flat.many_sample_squares`` and ``tensordot``) and, through the DP
optimizer, against micro-batching (float64)."""

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import relative_error
from workbench.clipping import engine, grouped
from workbench.clipping.flat import many_sample_squares
from workbench.clipping.grouped import Grouped
from workbench.clipping.nonfinite import masked
from workbench.dpsgd import DPOptimizer

CE = nn.CrossEntropyLoss(reduction="none")


def twin(grads: dict, group_of, c: dict, ok=None):
    """({group: Σ_p ||g_p,i||²}, {key: Σ_i c_G,i g_i}) parameter by parameter."""
    squares: dict = {}
    for key, sq in zip(grads, many_sample_squares(list(grads.values()))):
        squares[group_of(key)] = squares.get(group_of(key), 0) + sq
    sums = {key: torch.tensordot(c[group_of(key)].to(g.dtype),
                                 g if ok is None else masked(g, ok), dims=1)
            for key, g in grads.items()}
    return squares, sums


def filled(n, params, group_of, parts, dtype_of=lambda key: torch.float64, seed=0):
    """A Grouped with ``parts`` [(key, shape)] put in order (a key twice: a shared parameter),
    and the twin's {key: summed g}."""
    gen = torch.Generator().manual_seed(seed)
    together, loose = Grouped(n, params, group_of), {}
    for key, shape in parts:
        g = torch.randn(n, *shape, generator=gen, dtype=torch.float64).to(dtype_of(key))
        loose[key] = g if key not in loose else loose[key] + g
        together.put(key, g)
    return together, loose


SHAPES = {1: (4, 5), 2: (5,), 3: (6, 4), 4: (3, 2, 2), 5: (7,), 6: (2,), 7: (3,)}


@pytest.mark.parametrize("several", [False, True])  # one buffer per group, or several
@pytest.mark.parametrize("n", [0, 1, 6])
def test_squares_and_sums_match_the_per_parameter_twin(monkeypatch, several, n):
    monkeypatch.setattr(grouped, "CHUNK", 10 * max(n, 1) if several else 2**14)
    monkeypatch.setattr(grouped, "SMALL", 20 * max(n, 1))  # parameter 3 (24 numbers): loose
    params = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    group_of = {1: "a", 2: "b", 3: "a", 4: "a", 5: "b", 6: "a", 7: "b"}.get
    parts = [(1, SHAPES[1]), (2, SHAPES[2]), (3, SHAPES[3]), (4, SHAPES[4]), (1, SHAPES[1]),
             (5, SHAPES[5]), (6, SHAPES[6])]  # 1 used twice; 7 planned, never reached
    together, loose = filled(n, params, group_of, parts)
    loose_keys = {3} if n else set()  # n = 0: every parameter is small
    assert set(together.filled) == {1, 2, 4, 5, 6} - loose_keys | ({3} - loose_keys)
    assert set(together.loose) == loose_keys
    if several and n:
        assert len(together.buffers) > 2  # the columns split over several buffers
    zeros = torch.zeros(n, dtype=torch.float64)
    c = {g: torch.rand(n, dtype=torch.float64) for g in "ab"}
    squares, sums = twin(loose, group_of, c)
    got = together.squares(zeros)
    assert set(got) == set(squares)
    for group, sq in squares.items():
        torch.testing.assert_close(got[group], sq, rtol=1e-12, atol=0)
    got_sums = together.weighted_sums(c)
    assert set(got_sums) == set(sums)  # 7: no sum (as a parameter no call reached)
    for key, s in sums.items():
        assert got_sums[key].shape == s.shape
        torch.testing.assert_close(got_sums[key], s, rtol=1e-12, atol=1e-15)


def test_mixed_dtypes_take_a_buffer_each_and_a_late_part_of_another_dtype_goes_loose(
        monkeypatch):
    monkeypatch.setattr(grouped, "SMALL", 2**15)
    params = {1: torch.zeros(3, 2), 2: torch.zeros(4, dtype=torch.float64),
              3: torch.zeros(5), 4: torch.zeros(2, dtype=torch.float64)}
    dtypes = {1: torch.float32, 2: torch.float64, 3: torch.float32, 4: torch.float64}
    parts = [(1, (3, 2)), (2, (4,)), (3, (5,)), (4, (2,)), (4, (2,))]
    together, loose = filled(5, params, lambda key: None, parts, dtype_of=dtypes.get)
    assert {buf.dtype for buf in together.buffers.values()} == {torch.float32, torch.float64}
    late = torch.randn(5, 5, dtype=torch.float64)  # parameter 3's second call, in float64
    together.put(3, late)
    loose[3] = loose[3] + late
    assert 3 in together.loose and 3 not in together.filled
    c = {None: torch.rand(5, dtype=torch.float64)}
    squares, sums = twin(loose, lambda key: None, c)
    torch.testing.assert_close(together.squares(torch.zeros(5, dtype=torch.float64))[None],
                               squares[None], rtol=1e-6, atol=0)  # float32 rounding
    for key, s in together.weighted_sums(c).items():
        assert s.dtype == loose[key].dtype
        torch.testing.assert_close(s, sums[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("small", [0, 2**15])
def test_a_nonfinite_row_is_masked_not_multiplied(monkeypatch, small):
    monkeypatch.setattr(grouped, "SMALL", small)
    params = {1: torch.zeros(3, 2, dtype=torch.float64), 2: torch.zeros(4, dtype=torch.float64)}
    together, loose = filled(4, params, lambda key: None, [(1, (3, 2)), (2, (4,))])
    nan = torch.full((3, 2), float("nan"), dtype=torch.float64)
    together.put(1, torch.stack([nan] + [torch.zeros(3, 2, dtype=torch.float64)] * 3))
    loose[1] = loose[1].clone()
    loose[1][0] = float("nan")
    ok = torch.tensor([False, True, True, True])
    c = {None: masked(torch.rand(4, dtype=torch.float64), ok)}
    _, sums = twin(loose, lambda key: None, c, ok)
    got = together.weighted_sums(c, ok)
    for key, s in sums.items():
        assert torch.isfinite(got[key]).all()
        torch.testing.assert_close(got[key], s, rtol=1e-12, atol=0)


@pytest.mark.parametrize("small", [0, 2**15])
def test_an_overflowing_row_takes_the_overflow_safe_twin(monkeypatch, small):
    monkeypatch.setattr(grouped, "SMALL", small)
    params = {1: torch.zeros(3), 2: torch.zeros(4)}
    together = Grouped(2, params, lambda key: None)
    together.put(1, torch.full((2, 3), 3e38))  # ||row||² overflows float32
    together.put(2, torch.ones(2, 4))
    squares = together.squares(torch.zeros(2, dtype=torch.float64))[None]
    expected = sum(many_sample_squares([torch.full((2, 3), 3e38), torch.ones(2, 4)]))
    assert torch.isfinite(squares).all() and torch.equal(squares, expected)


class Shared(nn.Module):
    """A Linear called twice (a shared parameter), a frozen layer, a weight also read outside
    its layer (the exact whole-model fallback), a parameter of the model's own (a broadcast
    rule), a LayerNorm, and optionally a float32 layer in a float64 model (a second buffer)."""

    def __init__(self, mixed=False):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.twice = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.f32 = nn.Linear(6, 6) if mixed else None
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x) + 0.5 * torch.tanh(x @ self.inp.weight.T))
        h = self.twice(torch.tanh(self.twice(self.frozen(h)))) * self.scale
        if self.f32 is not None:
            h = self.f32(h.float()).double()
        return self.head(self.norm(h))


def shared_model(mixed=False):
    torch.manual_seed(0)
    model = Shared(mixed).double()
    if mixed:
        model.f32.float()
    return model


@pytest.mark.parametrize("mode", ["einsum", "vmap", "microbatch"])
@pytest.mark.parametrize("chunk", [None, 2**14, 64])  # None: the default, every tensor loose
def test_the_optimizer_step_is_micro_batchings_clipped_sum(monkeypatch, mode, chunk):
    if chunk is not None:
        monkeypatch.setattr(grouped, "SMALL", 2**15)
        monkeypatch.setattr(grouped, "CHUNK", chunk)
    made = []
    monkeypatch.setattr(engine, "Grouped", lambda *a: made.append(Grouped(*a)) or made[-1])
    model = shared_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,),
                                                                               generator=g)
    expected = wb.clipped_grad_sum(model, CE, x, y, 0.3, method="microbatch")
    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                      model, noise_multiplier=0.0, max_grad_norm=0.3, expected_batch_size=7.0,
                      method=mode)
    for _ in range(2):  # the first step checked, the second not
        opt.zero_grad()
        CE(model(x), y).mean().backward()
        opt.step()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert relative_error(p.grad, expected[name] / 7.0) <= 1e-9, (mode, name)
    opt.detach()
    keys = {id(p): k for k, p in model.named_parameters()}
    last = made[-1]
    assert "inp.weight" in {keys[k] for k in last.loose}  # the fallback's: as they came
    assert not any(keys[k].startswith("frozen") for k in last.slot)
    if chunk is None:
        assert not last.buffers and not last.filled
        return
    assert {keys[k] for k in last.filled} >= {"twice.weight", "norm.weight"}
    assert "scale" in {keys[k] for k in last.loose}  # a layer scale, materialised in the
    # backward pass since 2026-12-01 (``bookkeeping.STREAMED``): as it came
    assert (len(last.buffers) > 1) == (chunk == 64)


@pytest.mark.parametrize("small", [0, 2**15])
def test_mixed_dtypes_and_per_layer_groups_in_the_optimizer(monkeypatch, small):
    monkeypatch.setattr(grouped, "SMALL", small)
    model = shared_model(mixed=True)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,),
                                                                               generator=g)
    first = [*model.inp.parameters(), *model.twice.parameters(), model.scale]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in map(id, first)]
    groups = [{"params": first}, {"params": rest}]
    C = [0.2, 0.4]
    opt = DPOptimizer(torch.optim.SGD(groups, lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=6.0, method="einsum")
    opt.verify = False  # its checks compare at the first parameter's (float64) tolerance
    opt.zero_grad()
    CE(model(x), y).mean().backward()
    opt.step()
    opt.detach()
    grads = wb.per_sample_gradients(model, CE, x, y, method="microbatch")
    names = [[k for k, p in model.named_parameters() if any(p is q for q in grp["params"])]
             for grp in groups]
    for group_names, C_g in zip(names, C):  # every backprop passes the float32 layer:
        norms = torch.stack([grads[k].double().flatten(1).pow(2).sum(1)
                             for k in group_names]).sum(0).sqrt()
        c = (C_g / norms).clamp(max=1.0)
        for k in group_names:
            expected = torch.tensordot(c.to(grads[k].dtype), grads[k], dims=1) / 6.0
            assert relative_error(model.get_parameter(k).grad, expected) <= 1e-5, k  # rounded
