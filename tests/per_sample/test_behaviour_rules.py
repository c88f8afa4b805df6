"""Rules found by what a layer computes (RMSNorm family, LayerNorm2d, GPT-2's Conv1D), and the
registry's invariant: a subclass that changes ``forward`` never inherits its parent's rule.

The layers below copy the forward passes of Hugging Face's and timm's classes (so the test
needs neither library); tests/per_sample/test_real_models.py runs the real classes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    assert_optimizer_matches_microbatch,
    mse_per_sample,
)
from workbench.clipping.registry import find_norm_sampler
from workbench.per_sample.registry import find_grad_sampler
from workbench.rules.affine import affine_grad_sampler, affine_layout
from workbench.rules.linear import transposed_linear_grad_sampler
from workbench.rules.norm_activation import norm_activation_grad_sampler
from workbench.rules.norms import layer_norm_grad_sampler
from workbench.rules.std_conv import std_conv_eps, std_conv_grad_sampler


class LlamaRMSNorm(nn.Module):  # transformers' LlamaRMSNorm: statistics in float32
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(d)), eps

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):  # transformers' GemmaRMSNorm: (1 + w), zero init
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight)


class LayerNorm2d(nn.LayerNorm):  # timm's LayerNorm2d: channels first
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Conv1D(nn.Module):  # transformers' GPT-2 Conv1D: o = a W + c, W (d, p)
    def __init__(self, p, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(d, p)), nn.Parameter(torch.zeros(p))

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.weight.size(1),))


class ScaledLayerNorm(nn.LayerNorm):  # changes forward: 2 (â w + β) is not â w + β
    def forward(self, x):
        return 2 * super().forward(x)


class SquaredLayerNorm(nn.LayerNorm):  # changes forward, not affine in w at all
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps) ** 2


class PlainLayerNorm(nn.LayerNorm):  # a new __init__ only: computes as its parent
    def __init__(self, d):
        super().__init__(d, eps=1e-6)


class GRN(nn.Module):  # transformers' ConvNextV2GRNLayer: weight and bias (1, 1, 1, C)
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, 1, 1, d))
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, d))

    def forward(self, x):  # (n, H, W, C): a global response norm per sample and channel
        g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        return self.weight * (x * (g / (g.mean(dim=-1, keepdim=True) + 1e-6))) + self.bias + x


class ChannelScale(nn.Module):  # a (C, 1, 1) scale on (n, C, H, W), right-aligned
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, 1, 1))

    def forward(self, x):
        return x * self.weight


def standardise(weight, eps, unbiased=False):
    """timm's and Hugging Face's weight standardisation: F.batch_norm over each filter."""
    if unbiased:  # the sample variance: another function, never the rule's
        w = weight.reshape(weight.shape[0], -1)
        return ((w - w.mean(1, keepdim=True)) / (w.var(1, keepdim=True) + eps).sqrt()
                ).reshape_as(weight)
    return F.batch_norm(weight.reshape(1, weight.shape[0], -1), None, None, training=True,
                        momentum=0.0, eps=eps).reshape_as(weight)


class StdConv2d(nn.Conv2d):  # timm's StdConv2d (ResNetV2 / BiT)
    def __init__(self, *args, eps=1e-6, unbiased=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps, self.unbiased = eps, unbiased

    def forward(self, x):
        return F.conv2d(x, standardise(self.weight, self.eps, self.unbiased), self.bias,
                        self.stride, self.padding, self.dilation, self.groups)


class StdConv1d(nn.Conv1d):
    def __init__(self, *args, eps=1e-5, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x):
        return F.conv1d(x, standardise(self.weight, self.eps), self.bias, self.stride,
                        self.padding, self.dilation, self.groups)


class DynamicPad2d(nn.Module):  # Hugging Face's BiT: "SAME" padding computed per input
    def __init__(self, k, s):
        super().__init__()
        self.k, self.s = k, s

    def forward(self, x):
        pads = [max((-(-n // self.s) - 1) * self.s + self.k - n, 0) for n in x.shape[-2:]]
        return F.pad(x, [pads[1] // 2, pads[1] - pads[1] // 2, pads[0] // 2,
                         pads[0] - pads[0] // 2])


class WeightStandardizedConv2d(nn.Conv2d):  # Hugging Face's BiT layer, its pad a child
    def __init__(self, c, o, k, stride, eps=1e-8):
        super().__init__(c, o, k, stride=stride, padding=0, bias=False)
        self.pad, self.eps = DynamicPad2d(k, stride), eps

    def forward(self, x):
        x = self.pad(x)
        return F.conv2d(x, standardise(self.weight, self.eps), None, self.stride, 0,
                        self.dilation, self.groups)


class ScaledStdConv2d(StdConv2d):  # NFNets: a learned gain too, so not the rule's function
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))

    def forward(self, x):
        return F.conv2d(x, self.gain * standardise(self.weight, self.eps), self.bias,
                        self.stride, self.padding, self.dilation, self.groups)


class GroupNormActivation(nn.GroupNorm):  # Hugging Face's BitGroupNormActivation
    def __init__(self, groups, channels, act):
        super().__init__(groups, channels)
        self.activation = act

    def forward(self, x):
        return self.activation(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class LayerNormActivation(nn.LayerNorm):
    def __init__(self, d, act):
        super().__init__(d)
        self.act = act

    def forward(self, x):
        return self.act(F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps))


class BatchCentred(nn.Module):  # an "activation" that mixes the samples: never the rule's
    def forward(self, x):
        return torch.tanh(x - x.mean(0, keepdim=True))


class ActivationFirst(GroupNormActivation):  # act before the norm: another function
    def forward(self, x):
        return F.group_norm(self.activation(x), self.num_groups, self.weight, self.bias,
                            self.eps)


D = 5
CASES = {
    "grn": (GRN(D), (6, 3, 2, D), affine_grad_sampler),  # size-1 dims summed too
    "channel_scale": (ChannelScale(D), (6, D, 3, 2), affine_grad_sampler),
    "llama_rms": (LlamaRMSNorm(D), (6, 3, D), affine_grad_sampler),
    "gemma_rms": (GemmaRMSNorm(D), (6, 3, D), affine_grad_sampler),
    "layer_norm_2d": (LayerNorm2d(D), (6, D, 3, 2), affine_grad_sampler),
    "conv1d": (Conv1D(4, D), (6, 3, D), transposed_linear_grad_sampler),
    "conv1d_one_position": (Conv1D(4, D), (6, D), transposed_linear_grad_sampler),
    "scaled_layer_norm": (ScaledLayerNorm(D), (6, 3, D), None),
    "squared_layer_norm": (SquaredLayerNorm(D), (6, 3, D), None),
    "plain_layer_norm": (PlainLayerNorm(D), (6, 3, D), layer_norm_grad_sampler),
    "std_conv": (StdConv2d(3, 4, 3, padding=1), (6, 3, 5, 5), std_conv_grad_sampler),
    "std_conv_grouped_strided": (StdConv2d(4, 6, 3, stride=2, groups=2, eps=1e-5),
                                 (6, 4, 7, 7), std_conv_grad_sampler),
    "std_conv1d": (StdConv1d(3, 4, 3), (6, 3, 9), std_conv_grad_sampler),
    "std_conv_dynamic_pad": (WeightStandardizedConv2d(3, 4, 3, stride=2), (6, 3, 7, 7),
                             std_conv_grad_sampler),
    "std_conv_unbiased": (StdConv2d(3, 4, 3, unbiased=True), (6, 3, 5, 5), None),
    "scaled_std_conv": (ScaledStdConv2d(3, 4, 3), (6, 3, 5, 5), None),
    "group_norm_relu": (GroupNormActivation(2, 4, nn.ReLU()), (6, 4, 3, 3),
                        norm_activation_grad_sampler),
    "group_norm_relu_in_place": (GroupNormActivation(2, 4, nn.ReLU(inplace=True)),
                                 (6, 4, 3, 3), norm_activation_grad_sampler),
    "group_norm_identity": (GroupNormActivation(4, 4, nn.Identity()), (6, 4, 3),
                            norm_activation_grad_sampler),
    "layer_norm_silu": (LayerNormActivation(D, nn.SiLU()), (6, 3, D),
                        norm_activation_grad_sampler),
    "group_norm_activation_first": (ActivationFirst(2, 4, nn.Tanh()), (6, 4, 3, 3), None),
    "group_norm_prelu": (GroupNormActivation(2, 4, nn.PReLU()), (6, 4, 3, 3), None),
}


def regression(layer, shape):
    torch.manual_seed(0)
    model = nn.Sequential(layer, nn.Tanh()).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, x, y


@pytest.mark.parametrize("name", CASES)
def test_rule_found_by_behaviour_is_exact(name):
    layer, shape, rule = CASES[name]
    model, x, y = regression(layer, shape)
    assert find_grad_sampler(model[0]) is rule, name
    assert_agree(model, mse_per_sample, x, y, check="always")
    assert_clipping_agrees(model, mse_per_sample, x, y)
    routes = wb.ghost_routes(model, mse_per_sample, x, y)["route"].tolist()
    # no rule: vmap on the layer, or (a weight computed from parameters alone meeting the
    # batch in its conv) the meetings' route (per_sample/derived.py)
    assert ("vmap" in routes[0] or "derived" in routes[0]) == (rule is None), routes


def test_weight_standardisation_probe_finds_the_layers_eps():
    """The ε the layer computes with, found on a float64 probe (its own ``eps`` first, then
    the usual ones): a conv that standardises with another ε than its attribute says keeps
    vmap unless that ε is one the probe tries, and then the rule uses the one that fits."""
    assert std_conv_eps(StdConv2d(3, 4, 3, eps=1e-3)) == 1e-3  # the layer's own
    liar = StdConv2d(3, 4, 3, eps=1e-3)
    liar.forward = lambda x: F.conv2d(x, standardise(liar.weight, 1e-5), liar.bias)
    assert std_conv_eps(liar) == 1e-5
    odd = StdConv2d(3, 4, 3, eps=1e-3)
    odd.forward = lambda x: F.conv2d(x, standardise(odd.weight, 0.5), odd.bias)
    assert std_conv_eps(odd) is None and find_grad_sampler(odd) is None


def test_an_activation_that_mixes_samples_is_not_the_norm_activation_rule():
    """(1) of rules/norm_activation.py needs act to treat each sample alone: the probe runs a
    sample alone through it, and a batch-centred "activation" fails it (per-layer vmap)."""
    from workbench.rules.norm_activation import norm_activation

    assert not norm_activation(GroupNormActivation(2, 4, BatchCentred()))
    assert find_grad_sampler(GroupNormActivation(2, 4, BatchCentred())) is None
    assert norm_activation(GroupNormActivation(2, 4, nn.Tanh()))


def test_a_changed_eps_is_probed_again_not_kept():
    """The rule's ε is the one the layer computes with now: set ``eps`` after a first call
    (weights small enough that ε matters) and the per-sample gradients still equal
    micro-batching's, with the self-check off."""
    model, x, y = regression(StdConv2d(3, 4, 3, padding=1), (6, 3, 5, 5))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
    wb.per_sample_gradients(model, mse_per_sample, x, y, method="einsum")
    model[0].eps = 1e-5  # comparable to the filters' variance (~1e-6): a different W'
    assert std_conv_eps(model[0]) == 1e-5
    got = wb.per_sample_gradients(model, mse_per_sample, x, y, method="einsum", check=False)
    want = wb.per_sample_gradients(model, mse_per_sample, x, y, method="microbatch")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


def test_weight_standardised_conv_in_the_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(StdConv2d(3, 4, 3, padding=1), nn.ReLU(),
                          WeightStandardizedConv2d(4, 4, 3, stride=2), nn.Flatten(),
                          nn.LazyLinear(3)).double()
    batches = [(torch.randn(n, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (n,)))
               for n in (5, 3, 6)]
    model(batches[0][0])  # the lazy head's shape
    loss = nn.CrossEntropyLoss(reduction="none")
    for verify in (True, False):
        assert_optimizer_matches_microbatch(model, loss, batches, verify=verify)


def test_subclass_changing_forward_never_inherits_its_parents_rule():
    for cls in (ScaledLayerNorm, SquaredLayerNorm, LayerNorm2d):
        assert find_grad_sampler(cls(D)) is not layer_norm_grad_sampler, cls
        assert find_norm_sampler(cls(D)) is None, cls
    assert find_grad_sampler(PlainLayerNorm(D)) is layer_norm_grad_sampler


def test_behaviour_probe_reads_the_layout_not_the_name():
    assert affine_layout(LayerNorm2d(D).double()) == "channel"
    assert affine_layout(LlamaRMSNorm(D)) == "last"
    assert affine_layout(SquaredLayerNorm(D)) is None
    assert affine_layout(nn.Linear(D, D)) is None  # weight (p, d) times a, not elementwise


def test_the_layout_probe_runs_once_per_layer_and_weight_layout():
    """The grad rule reads the layout its probe found (three forward passes on probe inputs)
    from a cache, per layer and weight shape and dtype: a call costs its own two passes."""
    from workbench.rules.affine import layout_of

    layer, forwards = LlamaRMSNorm(D).double(), []
    own = layer.forward
    layer.forward = lambda h: forwards.append(h.shape) or own(h)  # probes call .forward
    a, b = torch.randn(4, 3, D, dtype=torch.float64), torch.randn(4, 3, D, dtype=torch.float64)
    assert layout_of(layer) == "last"
    probes = len(forwards)
    for _ in range(3):
        affine_grad_sampler(layer, (a,), b)
    assert len(forwards) == probes + 3 * 3  # B(a) = o(w = 1) - o(w = 0), and o near w
    layer.float()  # (``still_affine``: the probe's verdict on the call's own input)
    assert layout_of(layer) == "last" and len(forwards) > probes + 9  # a new dtype: probed


class ClampedRMSNorm(nn.RMSNorm):  # affine on the probe's inputs, clamped on large ones
    def forward(self, x):
        return super().forward(x).clamp(-2.5, 2.5)


class BranchOnData(nn.LayerNorm):  # w² where the input is large: the probe never gets there
    def forward(self, x):
        w = torch.where(x.abs() > 4, self.weight ** 2, self.weight)
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps) * w + self.bias


@pytest.mark.parametrize("cls", [ClampedRMSNorm, BranchOnData])
def test_a_rule_found_by_behaviour_is_checked_on_each_calls_input(cls):
    """Each call reruns the layer near its own weight on its own input: a record beyond the
    clamp or the branch (not the self-checked last one) was 3.7e-2 off, silently, in the
    optimizer until 2026-11-30; the first call's batch is harmless, the second's is not."""
    torch.manual_seed(0)
    model = nn.Sequential(cls(8), nn.Linear(8, 2)).double()  # weight 1: |o| = 1 on ±1 rows
    g = torch.Generator().manual_seed(0)
    calm = torch.randint(0, 2, (4, 3, 8), generator=g).double() * 2 - 1  # â = ±1
    wild = calm.clone()
    wild[0, 0, 0] = 40.0  # record 0 reaches the clamp / the branch; the last one does not
    y = torch.randn(4, 3, 2, dtype=torch.float64)

    def loss(o, t):
        return ((o - t) ** 2).sum((1, 2))

    wb.clipped_grad_sum(model, loss, calm, y, 1.0, method="ghost")
    for method in ("einsum", "ghost", "bookkeeping"):
        with pytest.raises(wb.UnsupportedLayerError, match="not on this batch"):
            wb.clipped_grad_sum(model, loss, wild, y, 1.0, method=method)
    opt = wb.dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4,
                               loss_reduction="sum")
    try:
        opt.zero_grad()
        loss(model(calm), y).sum().backward()
        opt.step()
        opt.zero_grad()
        loss(model(wild), y).sum().backward()
        with pytest.raises(wb.UnsupportedLayerError, match="not on this batch"):
            opt.step()
    finally:
        opt.detach()


class GemmaRMSNormFloat32(GemmaRMSNorm):  # transformers' own: (1 + w) multiplied in float32
    def forward(self, x):
        out = self._norm(x.float()) * (1.0 + self.weight.float())
        return out.type_as(x)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class NearlyAffine(GemmaRMSNorm):  # float64 throughout, 1e-6 w² away from affine: no rule
    def forward(self, x):
        return super().forward(x) + 1e-6 * self.weight ** 2


class SquaredInFloat32(GemmaRMSNormFloat32):  # float32 inside, not affine in w: no rule
    def forward(self, x):
        return (super().forward(x).float() ** 2).type_as(x)


def test_rule_probe_takes_the_tolerance_of_the_dtype_a_layer_computes_in():
    """Gemma's RMSNorm in a float64 model is affine in w up to float32 rounding only, as is its
    own autograd gradient: the rule is as exact as the layer (float32 rounding, 1e-5)."""
    assert affine_layout(GemmaRMSNormFloat32(D).double()) == "last"
    assert affine_layout(NearlyAffine(D).double()) is None
    assert affine_layout(SquaredInFloat32(D).double()) is None
    model, x, y = regression(GemmaRMSNormFloat32(D), (6, 3, D))
    assert find_grad_sampler(model[0]) is affine_grad_sampler
    ref = wb.per_sample_gradients(model, mse_per_sample, x, y, method="microbatch")
    for method in ("einsum", "vmap"):
        got = wb.per_sample_gradients(model, mse_per_sample, x, y, method=method)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7)
    C = 1.0
    want = wb.clipped_grad_sum(model, mse_per_sample, x, y, C, method="microbatch")
    for method in ("ghost", "bookkeeping", "einsum"):
        got = wb.clipped_grad_sum(model, mse_per_sample, x, y, C, method=method)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_a_rule_returning_another_shape_than_its_parameter_is_refused():
    """A rule's per-sample gradient must be (n, *p.shape): one that summed over the wrong dims
    is refused before its numbers reach a sum or a norm (``einsum.check_shapes``)."""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(1, D))

        def forward(self, x):
            return x * self.s

    @wb.register_grad_sampler(Scale)
    def wrong(layer, activations, backprops):  # forgets the (1, D) shape: (n, D)
        return {"s": (activations[0] * backprops).sum(1)}

    try:
        model, x, y = regression(Scale(), (4, 3, D))
        for method in ("einsum", "ghost"):
            with pytest.raises(wb.PerSampleCheckError, match=r"Scale at 0.*shape \(4, 5\).*"
                                                           r"\(4, 1, 5\)"):
                if method == "einsum":
                    wb.per_sample_gradients(model, mse_per_sample, x, y, method="einsum")
                else:
                    wb.clipped_grad_sum(model, mse_per_sample, x, y, 1.0, method="ghost")
    finally:
        from workbench.per_sample.registry import GRAD_SAMPLERS
        GRAD_SAMPLERS.pop(Scale, None)


@pytest.mark.parametrize(("name", "frozen"), [
    ("std_conv", None), ("std_conv_grouped_strided", None), ("std_conv1d", None),
    ("std_conv_dynamic_pad", None), ("std_conv", "weight"), ("std_conv_grouped_strided", "bias")])
@pytest.mark.parametrize("gram", [True, False])
def test_weight_standardised_norm_needs_no_per_sample_gradient(name, frozen, gram, monkeypatch):
    """The norm rule's Eq. (2) (rules/std_conv.py: the convolution's Gram norm of b / s, two
    forward convolutions) equals ||g_i||² of the materialised per-sample gradients, in float64
    to 1e-10, with either parameter frozen too; and in float32 to the dtype's tolerance. Both
    routes, whichever the shapes would pick."""
    from workbench.rules import std_conv
    from workbench.rules.std_conv import std_conv_norm_sampler

    monkeypatch.setattr(std_conv, "gram_is_cheaper", lambda *dims: gram)

    layer, shape, _ = CASES[name]
    model, x, _ = regression(layer, shape)
    conv = model[0]
    if conv.bias is None and frozen == "weight":  # a bias left to train
        conv.bias = nn.Parameter(torch.randn(conv.out_channels, dtype=torch.float64))
        assert std_conv_eps(conv) is not None  # probed again: it has a bias now
    if frozen is not None:
        getattr(conv, frozen).requires_grad_(False)
    b = torch.randn_like(conv(x))
    grads = std_conv_grad_sampler(conv, (x,), b)
    want = sum(g.flatten(1).square().sum(1) for k, g in grads.items()
               if getattr(conv, k).requires_grad)
    torch.testing.assert_close(std_conv_norm_sampler(conv, (x,), b), want, rtol=1e-10, atol=0)
    conv.float()
    got = std_conv_norm_sampler(conv, (x.float(),), b.float())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_kept_rule_answers_follow_every_change_of_the_tables():
    """``find_rule`` keeps its answer per layer; a table changed by any path (the decorator,
    item assignment, ``del``, ``pop``) or a behaviour rule appended gives the new answer."""
    from workbench.clipping.registry import NORM_SAMPLERS, find_norm_sampler
    from workbench.per_sample.registry import GRAD_BEHAVIOURS, GRAD_SAMPLERS

    class Doubled(nn.Linear):  # changes forward: no rule of its parent's
        def forward(self, x):
            return 2 * super().forward(x)

    layer = Doubled(2, 3)
    assert find_grad_sampler(layer) is None and find_norm_sampler(layer) is None

    def rule(*args):
        return {}

    GRAD_SAMPLERS[Doubled] = rule
    NORM_SAMPLERS.update({Doubled: rule})
    assert find_grad_sampler(layer) is rule and find_norm_sampler(layer) is rule
    del GRAD_SAMPLERS[Doubled]
    NORM_SAMPLERS.pop(Doubled)
    assert find_grad_sampler(layer) is None and find_norm_sampler(layer) is None
    GRAD_BEHAVIOURS.append((lambda m: isinstance(m, Doubled), rule))
    try:
        assert find_grad_sampler(layer) is rule
    finally:
        GRAD_BEHAVIOURS.pop()
    assert find_grad_sampler(Doubled(2, 3)) is None


class BiasTwice(nn.Linear):  # its bias in F.linear and broadcast once more
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.bias


class MaskedBiasAgain(nn.Linear):  # and once more under a per-record mask
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + (x[..., :1] > 0) * self.bias


@pytest.mark.parametrize("cls", [BiasTwice, MaskedBiasAgain])
@pytest.mark.parametrize("check", [True, False])
def test_a_parameter_taken_by_two_functional_calls_counts_both(cls, check):
    """Two tied.py layers (the functional linear and a broadcast) take the same bias over
    from its rule-less owner: the one kept last dropped the other's part (0.5 off with the
    check off, a misleading PerSampleCheckError with it, until 2026-11-30)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Tanh(), cls(6, 6)).double()
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 6, dtype=torch.float64)
    assert_agree(model, mse_per_sample, x, y, check=check)
    assert_clipping_agrees(model, mse_per_sample, x, y)
