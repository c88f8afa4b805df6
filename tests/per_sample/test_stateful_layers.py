"""A layer without a rule whose forward reads state the pass changes is never re-run alone.

Per-layer vmap and per-layer micro-batching re-run a recorded call's forward after the pass.
A forward that reads an attribute which it (or its model, after the call) rebinds or writes
in place computes something else when re-run: RecurrentGemma's RG-LRU starts its scan from
``self.recurrent_states``, which each call overwrites. With the state detached (no graph
error to give it away) the per-sample gradients were silently wrong before; at n = 1 on
RecurrentGemma itself (position ids of shape (1, T) pass the batch check there) torch's
"backward through the graph a second time". Now the recorder keeps each layer's attribute
bindings and buffer versions before its first call (``hooks.state_of``) and such a layer
takes the exact whole-model fallback (``recording.stateful``), where the model sets the state
up as the user's pass did. Every case: every method and optimizer mode, check on and off,
n = 1 among the sizes.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import (
    assert_agree,
    assert_clipped_sums_agree,
    assert_optimizer_matches_microbatch,
)
from workbench.clipping.routes import ghost_routes


class Cell(nn.Module):
    """A layer without a rule: tanh(x W), and whatever state its subclass reads."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 4) / 2)


class Carried(Cell):
    """Adds the previous call's output (detached): the state its next call starts from."""

    def __init__(self):
        super().__init__()
        self.state = None

    def forward(self, x):
        out = torch.tanh(x @ self.W)
        if self.state is not None:
            out = out + self.state
        self.state = out.detach()
        return out


class Counted(Cell):
    """Scales by a buffer it increments in place: each call reads another count."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return torch.tanh(x @ self.W) * self.count.clone()  # the count at this call


class Scaled(Cell):
    """Reads a scale its model rebinds between (after) its calls."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return torch.tanh(x @ self.W) * self.scale


class Memory(nn.Module):
    """A parameter-free child holding the state: the layer's own attributes never change."""

    def __init__(self):
        super().__init__()
        self.state = None

    def forward(self, h):
        out = h if self.state is None else h + self.state
        self.state = out.detach()
        return out


class InChild(Cell):
    """Its forward runs its child's, which starts from the state the previous call left."""

    def __init__(self):
        super().__init__()
        self.mem = Memory()

    def forward(self, x):
        return self.mem(torch.tanh(x @ self.W))


class Model(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.cell, self.head = cell, nn.Linear(4, 3)

    def forward(self, x):
        cell = self.cell
        if isinstance(cell, Carried):
            cell.state = None
        elif isinstance(cell, Counted):
            cell.count.zero_()
        elif isinstance(cell, InChild):
            cell.mem.state = None
        else:
            cell.scale = 1.0
        h = cell(x)
        if isinstance(cell, Scaled):
            cell.scale = 3.0  # after the first call: a re-run of it would read 3
        return self.head(cell(h))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,),
                                                                                 generator=g)


CELLS = [Carried, Counted, Scaled, InChild]


def model_of(cell):
    torch.manual_seed(0)
    return Model(cell()).double()


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("check", [True, False])
def test_functional_methods_are_exact(cell, n, check):
    model = model_of(cell)
    x, y = batch(n, 0)
    vmap = () if cell is Counted else ("vmap",)  # whole-model vmap refuses in-place buffer
    # writes with a clear error (test_families.py); the fallback then micro-batches
    assert_agree(model, losses, x, y, methods=("einsum", *vmap), check=check)
    assert_clipped_sums_agree(model, losses, x, y, 0.05, check=check)


@pytest.mark.parametrize("cell", CELLS)
def test_the_layer_takes_the_whole_model_fallback_saying_why(cell):
    model = model_of(cell)
    x, y = batch(3, 0)
    routes = ghost_routes(model, losses, x, y)
    mine = routes[routes.layer == "cell"]
    assert (mine.route == "exact fallback").all(), mine
    assert mine.reason.str.contains("in its forward: a re-run of a call").all(), mine.reason
    head = routes[routes.layer == "head"]
    assert (head.route != "exact fallback").all()  # only the stateful layer leaves its rule


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("method", ["microbatch", "einsum", "bookkeeping", "auto"])
@pytest.mark.parametrize("verify", [True, False])
def test_optimizer_steps_are_exact(cell, method, verify):
    model = model_of(cell)
    batches = [batch(n, seed) for seed, n in enumerate((1, 3, 1, 2))]
    assert_optimizer_matches_microbatch(model, losses, batches, max_grad_norm=0.05,
                                        method=method, verify=verify)


class Cached(Cell):
    """Rebinds an attribute to the object it already holds, and reads no state: no change."""

    def __init__(self):
        super().__init__()
        self.table = torch.ones(4)

    def forward(self, x):
        self.table = self.table
        return torch.tanh(x @ self.W) * self.table


def test_an_unchanged_attribute_keeps_the_per_layer_route():
    torch.manual_seed(0)
    model = Model(Cached()).double()
    x, y = batch(3, 0)
    routes = ghost_routes(model, losses, x, y)
    assert (routes[routes.layer == "cell"].route != "exact fallback").all()
    assert_agree(model, losses, x, y, methods=("einsum",), check=False)


def test_changed_state_reads_rebinding_in_place_writes_and_none_buffers():
    from workbench.per_sample.hooks import changed_state, state_of

    layer = Counted()
    layer.register_buffer("empty", None)  # a None buffer is no state and no change
    before = state_of(layer)
    assert changed_state(layer, before) == []
    layer.count += 1  # in place: its version moves
    assert changed_state(layer, before) == ["count"]
    before = state_of(layer)
    layer.note = "new"  # an attribute added
    layer.count = torch.zeros(())  # a buffer rebound
    assert sorted(changed_state(layer, before)) == ["_buffers", "note"]
    cell = InChild()
    before = state_of(cell)
    cell.mem.state = torch.ones(4)  # a child's attribute, named by its path
    assert changed_state(cell, before) == ["mem.state"]
