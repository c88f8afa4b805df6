"""DPMultiheadAttention: drop-in equal to nn.MultiheadAttention, and per-sample gradients equal
to micro-batching in float64, for every supported option."""

import copy

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_agree, mse_per_sample
from tests.layers.wrappers import AttentionModel, relative_error
from workbench.layers import DPMultiheadAttention

E, HEADS, n, L, S = 8, 2, 3, 4, 5


def twins(seed=0, **options):
    """(nn.MultiheadAttention, DPMultiheadAttention) with the same float64 weights."""
    torch.manual_seed(seed)
    reference = nn.MultiheadAttention(E, HEADS, **options).double()
    with torch.no_grad():  # non-zero biases, so a wrong bias path cannot hide
        for name, p in reference.named_parameters():
            if "bias" in name:
                p.normal_()
    return reference, DPMultiheadAttention.from_torch(reference)


def data(batch_first=True, kdim=E, vdim=E, seed=1):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def lay(t):  # batch first (n, len, dim) -> the layer's layout
        return t if batch_first else t.transpose(0, 1)

    return lay(rand(n, L, E)), lay(rand(n, S, kdim)), lay(rand(n, S, vdim))


def masks(kind):
    """(key_padding_mask (n, S), attn_mask (L, S) or (n heads, L, S)) of the given kind."""
    pad = torch.tensor([[False] * S, [False] * (S - 2) + [True] * 2, [False] * (S - 1) + [True]])
    causal = torch.ones(L, S, dtype=torch.bool).triu(1 + S - L)
    g = torch.Generator().manual_seed(4)
    return {
        "none": (None, None),
        "bool": (pad, causal),
        "float": (pad.double() * -1e3, torch.randn(L, S, generator=g, dtype=torch.float64)),
        "3d": (None, torch.randn(n * HEADS, L, S, generator=g, dtype=torch.float64)),
    }[kind]


def assert_same(a, b, tol=1e-10):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and relative_error(x, y) <= tol


OPTIONS = [
    {},
    {"batch_first": True},
    {"bias": False},
    {"add_bias_kv": True},
    {"add_zero_attn": True},
    {"add_bias_kv": True, "add_zero_attn": True, "batch_first": True},
    {"kdim": 6, "vdim": 7},
    {"kdim": 6, "vdim": 7, "bias": False, "add_bias_kv": True, "batch_first": True},
]


def ids(options):
    return "-".join(f"{k}={v}" for k, v in options.items()) or "defaults"


# --- drop-in -------------------------------------------------------------------------------

@pytest.mark.parametrize("options", OPTIONS, ids=ids)
def test_same_names_shapes_init_and_state_dict(options):
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(E, HEADS, **options)
    torch.manual_seed(0)
    dp = DPMultiheadAttention(E, HEADS, **options)
    assert [(k, p.shape) for k, p in dp.named_parameters()] == \
        [(k, p.shape) for k, p in reference.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(dp.parameters(), reference.parameters()))
    assert list(dp.state_dict()) == list(reference.state_dict())
    nn.MultiheadAttention(E, HEADS, **options).load_state_dict(dp.state_dict())
    DPMultiheadAttention(E, HEADS, **options).load_state_dict(reference.state_dict())


@pytest.mark.parametrize("options", OPTIONS, ids=ids)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "3d"])
@pytest.mark.parametrize("need_weights, average", [(True, True), (True, False), (False, True)])
def test_outputs_equal_torch(options, mask_kind, need_weights, average):
    reference, dp = twins(**options)
    q, k, v = data(options.get("batch_first", False), options.get("kdim", E),
                   options.get("vdim", E))
    key_padding_mask, attn_mask = masks(mask_kind)
    kwargs = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                  need_weights=need_weights, average_attn_weights=average)
    assert_same(dp(q, k, v, **kwargs), reference(q, k, v, **kwargs))


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_equals_torch(batch_first):
    reference, dp = twins(batch_first=batch_first)
    x = data(batch_first)[0]
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    for kwargs in ({}, {"attn_mask": causal, "is_causal": True, "need_weights": False}):
        assert_same(dp(x, x, x, **kwargs), reference(x, x, x, **kwargs))


def test_unbatched_inputs_equal_torch():
    reference, dp = twins(add_bias_kv=True)
    q, k, v = (t[:, 0] for t in data(batch_first=False))  # (L, E), (S, E)
    for kwargs in ({}, {"key_padding_mask": masks("bool")[0][1], "average_attn_weights": False}):
        assert_same(dp(q, k, v, **kwargs), reference(q, k, v, **kwargs))


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_draws_the_same_masks_as_torch(need_weights):
    reference, dp = twins(dropout=0.3, batch_first=True)
    q, k, v = data(batch_first=True)
    torch.manual_seed(7)
    ours = dp(q, k, v, need_weights=need_weights)
    torch.manual_seed(7)
    theirs = reference(q, k, v, need_weights=need_weights)
    assert_same(ours, theirs)
    dp.eval()
    assert relative_error(dp(q, k, v)[0], ours[0]) > 1e-3  # dropout really was active


# --- per-sample gradients ------------------------------------------------------------------

def target_for(model, *inputs):
    with torch.no_grad():
        shape = model(*inputs).shape
    return torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


@pytest.mark.parametrize("options", OPTIONS, ids=ids)
def test_per_sample_gradients_cross_attention_with_masks(options):
    options = {**options, "batch_first": options.get("batch_first", False)}
    _, dp = twins(**options)
    key_padding_mask, attn_mask = masks("bool")
    model = AttentionModel(dp, attn_mask=attn_mask)
    q, k, v = data(True, options.get("kdim", E), options.get("vdim", E))  # batch first
    inputs = (q, k, v, key_padding_mask)
    assert_agree(model, mse_per_sample, inputs, target_for(model, *inputs), strict=True)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_per_sample_gradients_self_attention(batch_first, need_weights):
    _, dp = twins(batch_first=batch_first, add_bias_kv=True, add_zero_attn=True)
    model = AttentionModel(dp)
    x = data(True)[0]
    grads = assert_agree(model, mse_per_sample, x, target_for(model, x), strict=True)
    assert set(grads) == {"attention.in_proj_weight", "attention.in_proj_bias",
                          "attention.bias_k", "attention.bias_v", "attention.out_proj.weight",
                          "attention.out_proj.bias"}


def test_per_sample_gradients_with_per_sample_3d_mask():
    _, dp = twins(batch_first=True)

    class PerSampleMask(nn.Module):  # the (n heads, L, S) mask travels with its samples
        def __init__(self):
            super().__init__()
            self.attention = dp

        def forward(self, x, mask):  # mask: (n, heads, L, L)
            return self.attention(x, x, x, attn_mask=mask.flatten(0, 1))[0]

    x = data(True)[0]
    mask = torch.randn(n, HEADS, L, L, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)
    model = PerSampleMask()
    assert_agree(model, mse_per_sample, (x, mask), target_for(model, x, mask),
                 methods=("einsum",))


def test_dropout_per_sample_gradients_sum_to_the_batch_gradient():
    _, dp = twins(dropout=0.3, batch_first=True)
    model = AttentionModel(dp)
    x = data(True)[0]
    y = target_for(model, x)
    torch.manual_seed(5)
    grads = wb.per_sample_gradients(model, mse_per_sample, x, y, method="einsum")
    torch.manual_seed(5)
    params = dict(model.named_parameters())
    batch = torch.autograd.grad(mse_per_sample(model(x), y).sum(), list(params.values()))
    for name, g in zip(params, batch):
        assert relative_error(grads[name].sum(0), g) <= 1e-12, name


# --- conversions, sharing and errors --------------------------------------------------------

def test_conversions_and_sharing():
    reference, dp = twins(kdim=6, vdim=7, add_bias_kv=True)
    back = dp.eval().to_torch()
    assert type(back) is nn.MultiheadAttention and not back.training
    q, k, v = data(False, kdim=6, vdim=7)
    assert_same(back(q, k, v), dp(q, k, v))
    dp = copy.deepcopy(dp).float()
    assert dp.parts["in_proj"].k_weight is dp.k_proj_weight
    assert dp.k_proj_weight.dtype == torch.float32
    dp.load_state_dict({k: v + 1 for k, v in dp.state_dict().items()}, assign=True)
    assert dp.parts["bias_v"].bias is dp.bias_v


def test_errors():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        DPMultiheadAttention(10, 3)
    dp = DPMultiheadAttention(E, HEADS)
    q = torch.randn(L, n, E)
    with pytest.raises(RuntimeError, match="attn_mask"):
        dp(q, q, q, is_causal=True)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(3, 7\)"):
        dp(q, q, q, key_padding_mask=torch.zeros(n, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask has shape"):
        dp(q, q, q, attn_mask=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="expects an nn.MultiheadAttention"):
        DPMultiheadAttention.from_torch(nn.Linear(2, 2))
