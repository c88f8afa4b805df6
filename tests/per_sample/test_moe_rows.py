"""Layers without a rule on batch-flattened rows: a Mixture-of-Experts block (Mixtral's shape:
a top-k router and the experts' weights as 3-D parameters gathered per token, Hugging Face's
"batched_mm" experts) runs both on (n·T, d) tokens. The flattened-row proof follows the
router's ``topk``, the experts' ``repeat_interleave`` over dim 0, the weights gathered by a
tagged index, the batched products and the ``view`` back to (tokens, k, d). The router's
``F.linear`` on the proved rows is recorded as a Linear call inside its owner, each pick
``W[index]`` as a ``ParameterRows`` call (``per_sample/tied.py``, ``rules/gather.py``), so
neither layer needs per-layer vmap (which they took before, and which a rule-less layer whose
outputs are proved row by row still takes for its other parameters:
``flat_rows.rule_less_rows``). A rule-less layer that reorders the flattened rows by an op the
proof does not follow keeps the fallback. Exact against micro-batching in float64, every
method and optimizer mode, n = 1, n ≠ T and n = T, with and without the self-check, int32
and negative expert indices; the owner keeping a weight it also uses otherwise, and its other
parameters; a table picked by indices that are not the batch's, or outside its owner."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipped_sums_agree,
    assert_optimizer_matches_microbatch,
)
from workbench.dpsgd import MODES

T, D, E, K, C = 5, 6, 4, 2, 0.5


class Router(nn.Module):
    def __init__(self, extra=False, reuse=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) / D ** 0.5)
        self.extra = nn.Parameter(torch.eye(E) + torch.randn(E, E) / 4) if extra else None
        self.reuse = reuse

    def forward(self, h):  # (tokens, D)
        logits = F.linear(h, self.weight)
        if self.extra is not None:  # another parameter of the owner: its vmap's
            logits = logits @ self.extra
        if self.reuse:  # the weight used otherwise too: the owner's vmap keeps it
            logits = logits + self.weight.sum(1)
        top, index = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, index


class Experts(nn.Module):
    def __init__(self, index="int64"):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, 2 * D, D) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(E, D, 2 * D) / D ** 0.5)
        self.index = index

    def forward(self, h, index, weights):  # (tokens, D), (tokens, K), (tokens, K)
        tokens = h.shape[0]
        picked = h.repeat_interleave(K, dim=0)  # (tokens·K, D)
        ids = index.reshape(-1)
        if self.index == "int32":
            ids = ids.to(torch.int32)
        elif self.index == "negative":  # W[-1] is W[E - 1]
            ids = ids - E
        up = torch.bmm(self.up[ids], picked.unsqueeze(-1)).squeeze(-1)
        out = torch.bmm(self.down[ids], F.silu(up).unsqueeze(-1)).squeeze(-1)
        out = out * weights.reshape(-1).unsqueeze(-1)
        return out.view(tokens, K, D).sum(dim=1)


class Mixer(nn.Module):
    """Rule-less, and reorders each sample's flattened rows by an op the proof does not follow
    (``flip``): its outputs carry no proof of their rows, so it keeps the exact fallback."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, h):
        return h.view(-1, T, D).flip(1).reshape(-1, D) * self.scale


class MoE(nn.Module):
    def __init__(self, mix=False, index="int64", extra=False, reuse=False):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, D), nn.Linear(D, 11)
        self.gate, self.experts = Router(extra, reuse), Experts(index)
        self.mixer = Mixer() if mix else None

    def forward(self, ids):  # (n, T)
        h = self.embed(ids)
        n = h.shape[0]
        flat = h.view(-1, D)
        _, weights, index = self.gate(flat)
        flat = flat + self.experts(flat, index, weights)
        if self.mixer is not None:
            flat = flat + self.mixer(flat)
        return self.head(flat.reshape(n, T, D))


def losses(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (n, T), generator=g), torch.randint(0, 11, (n, T), generator=g)


def model_of(mix=False, **options):
    torch.manual_seed(0)
    return MoE(mix, **options).double()


def routes_of(model, x, y):
    table = wb.ghost_routes(model, losses, x, y)
    return dict(zip(table["layer"], table["route"]))


@pytest.mark.parametrize("n", [1, 3, T])
def test_router_and_experts_take_their_ops_rules_not_vmap(n):
    routes = routes_of(model_of(), *batch(n))
    assert not any("vmap" in r or "fallback" in r for r in routes.values()), routes
    assert "gate" not in routes and "experts" not in routes, routes  # nothing left to them
    assert "F.linear(gate.weight) in its owner" in routes, routes
    assert routes["gather(experts.up in its owner)"] == "segment sum", routes
    assert routes["gather(experts.down in its owner)"] == "segment sum", routes


def test_a_weight_also_used_otherwise_stays_with_its_owner():
    """The router's weight also enters a batch-free term: its Linear call is dropped and the
    owner's per-layer vmap over each sample's rows covers every use of it."""
    model, (x, y) = model_of(reuse=True), batch(T)
    routes = routes_of(model, x, y)
    assert "vmap" in routes["gate"] and not any(k.startswith("F.linear(gate") for k in routes)
    assert_agree(model, losses, x, y, methods=("einsum",), check=False)
    assert_clipped_sums_agree(model, losses, x, y, C, check=False)


@pytest.mark.parametrize("mode", ["microbatch", "vmap", "einsum", "bookkeeping"])
def test_the_owner_keeps_its_other_parameters_and_counts_nothing_twice(mode):
    """The router also holds ``extra``, used in a product no rule records: the owner's vmap
    samples ``extra`` alone, the Linear call ``weight`` (once, not in the vmap too)."""
    model = model_of(extra=True)
    routes = routes_of(model, *batch(T))
    assert "vmap" in routes["gate"] and "F.linear(gate.weight) in its owner" in routes
    assert_agree(model, losses, *batch(T), methods=("einsum",), check=False)
    batches = [batch(n, seed) for seed, n in ((0, 1), (1, T), (2, 3))]
    assert_optimizer_matches_microbatch(model, losses, batches, max_grad_norm=C,
                                        method=mode, verify=False)


def test_a_rule_less_layer_on_rows_not_proved_keeps_the_fallback():
    x, y = batch(3)
    routes = wb.ghost_routes(model_of(mix=True), losses, x, y)
    assert routes.set_index("layer").loc["mixer", "route"] == "exact fallback", routes


@pytest.mark.parametrize("mix,index", [(False, "int64"), (True, "int64"), (False, "int32"),
                                       (False, "negative")])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("n", [1, 3, T])
def test_functional_api_is_exact(mix, index, check, n):
    model, (x, y) = model_of(mix, index=index), batch(n, seed=n)
    assert_agree(model, losses, x, y, methods=("einsum",), check=check)
    assert_clipped_sums_agree(model, losses, x, y, C, check=check)


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize("index,verify", [("int64", True), ("int64", False),
                                          ("negative", False)])
def test_dp_optimizer_steps_are_exact(mode, index, verify):
    batches = [batch(n, seed) for seed, n in ((0, 3), (1, T), (2, 1), (3, T))]
    assert_optimizer_matches_microbatch(model_of(index=index), losses, batches,
                                        max_grad_norm=C, method=mode, verify=verify)


class TableInside(nn.Module):
    """A rule-less layer picking rows of its table by indices that are not the batch's (a
    position table by ``arange``): no ParameterRows call (its rows are not samples); the
    picked rows, computed from the parameter alone, meet the batch (``derived.py``)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(T, D))

    def forward(self, h):  # (n, T, D)
        return h * self.table[torch.arange(h.shape[1])]


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos, self.head = nn.Embedding(11, D), TableInside(), nn.Linear(D, 11)

    def forward(self, ids):
        return self.head(self.pos(self.embed(ids)))


@pytest.mark.parametrize("n", [1, T])
def test_indices_that_are_not_the_batch_keep_the_owner(n):
    torch.manual_seed(0)
    model, (x, y) = Positions().double(), batch(n)
    routes = routes_of(model, x, y)
    assert routes["pos"] == "derived (meetings)", routes
    assert not any(k.startswith("gather(") for k in routes), routes
    assert_agree(model, losses, x, y, methods=("einsum",))
    assert_clipped_sums_agree(model, losses, x, y, C)


class PickedOutside(nn.Module):
    """A table owned by a layer that is never called, picked by the batch's token ids in the
    model's own forward: outside its owner, a ParameterRows call."""

    def __init__(self, select=False):
        super().__init__()
        self.codes = nn.Module()
        self.codes.weight = nn.Parameter(torch.randn(11, D, 2))
        self.head = nn.Linear(2 * D, 11)
        self.select = select

    def forward(self, ids):  # (n, T)
        if self.select:  # the same pick by index_select, on the flattened ids
            picked = torch.index_select(self.codes.weight, 0, ids.reshape(-1))
            picked = picked.view(*ids.shape, D, 2)
        else:
            picked = self.codes.weight[ids]
        return self.head(torch.tanh(picked).flatten(2))


@pytest.mark.parametrize("select", [False, True])
@pytest.mark.parametrize("n", [1, 3, T])
def test_a_table_picked_outside_its_owner_by_the_batch(n, select):
    torch.manual_seed(0)
    model, (x, y) = PickedOutside(select).double(), batch(n, seed=n)
    x[0, 1] = x[0, 0]  # a row picked twice in one sample: its backprops summed first
    assert routes_of(model, x, y)["gather(codes.weight)"] == "segment sum"
    assert_agree(model, losses, x, y, methods=("einsum",))
    assert_clipped_sums_agree(model, losses, x, y, C)
    assert_optimizer_matches_microbatch(model, losses, [(x, y), batch(1, seed=9)],
                                        max_grad_norm=C, method="bookkeeping")


class Lookup(nn.Module):
    """A layer without a rule whose forward looks its table up itself (not an Embedding
    subclass): the lookup is recorded as an Embedding call inside its owner."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(11, D))

    def forward(self, ids):  # (n, T)
        return 2 * F.embedding(ids, self.weight, padding_idx=0)


class LookedUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lookup, self.head = Lookup(), nn.Linear(D, 11)

    def forward(self, ids):
        return self.head(torch.tanh(self.lookup(ids)))


@pytest.mark.parametrize("n", [1, 3, T])
def test_a_lookup_inside_a_rule_less_layer_takes_the_embedding_rule(n):
    torch.manual_seed(0)
    model, (x, y) = LookedUp().double(), batch(n, seed=n)
    x[0, 2] = 0  # a padding token: no gradient for row 0
    routes = routes_of(model, x, y)
    assert routes["F.embedding(lookup.weight, padding_idx=0) in its owner"] == "segment sum"
    assert "lookup" not in routes, routes
    assert_agree(model, losses, x, y, methods=("vmap", "einsum"))
    assert_clipped_sums_agree(model, losses, x, y, C, check=False)
    for mode in ("bookkeeping", "einsum"):
        assert_optimizer_matches_microbatch(model, losses, [(x, y), batch(1, seed=9)],
                                            max_grad_norm=C, method=mode, verify=False)


EAGER = {"qwen2_moe": ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16)),
         "olmoe": ("Olmoe", dict(num_experts=4, num_experts_per_tok=2)),
         "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2))}


@pytest.mark.realmodels
@pytest.mark.parametrize("n", [3, T])
@pytest.mark.parametrize("name", list(EAGER))
def test_eager_experts_of_real_models_prove_their_rows(name, n):
    """Hugging Face's "eager" experts (Qwen2-MoE, OLMoE, Mixtral): a loop over the experts
    hit, each one's tokens gathered (``h[token_idx]``), its weights picked by the loop's index
    (``gate_up_proj[expert_idx]``), the routing weights at ``[token_idx, top_k_pos]``, the
    outputs added back by ``final.index_add_(0, token_idx, ...)``. The rows are proved op by
    op (``flat_rows._row_writes``, ``_reorder``, ``_picked``): no layer call on unproved rows
    (until 2026-12-01 the experts' output, the final norm and the head: 3 calls, their
    parameters on the exact fallback), exact against a float64 loop over one record at a time
    (ghost to ``RTOL_FLOAT32_INSIDE``: these models' RMSNorm computes in float32, and ghost's
    second backward pass rounds each record's scaled gradient there, 4e-8 off, as for Llama)."""
    import copy
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed: pip install '.[realmodels]'")
    import warnings

    from workbench.per_sample.recording import record
    from workbench.realzoo import text
    from workbench.realzoo.reference import (
        RTOL,
        RTOL_FLOAT32_INSIDE,
        clipped_sum,
        norms_of,
        one_at_a_time,
        scale,
        verdict,
    )
    kind, config = EAGER[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = text.llama_like(kind, experts_implementation="eager", **config).double()
    g = torch.Generator().manual_seed(n)
    x, y = torch.randint(2, 32, (n, T), generator=g), torch.randint(0, 32, (n, T), generator=g)
    rec = record(copy.deepcopy(model), losses, x, y)
    unproved = {path for path, calls in rec.recorder.calls.items()
                if any(c.unproved or c.reordered for c in calls)}
    assert not unproved, unproved
    grads = one_at_a_time(model, losses, x, y)
    C = float(norms_of(grads).median())
    want = clipped_sum(grads, C)
    for method, rtol in (("einsum", RTOL), ("bookkeeping", RTOL), ("ghost", RTOL_FLOAT32_INSIDE)):
        got = wb.clipped_grad_sum(copy.deepcopy(model), losses, x, y, C, method=method)
        assert verdict(got, want, scale(want), rtol) == "exact", method
