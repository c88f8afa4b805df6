"""The optimizer's book-keeping streaming (dpsgd/streamed.py): Linear calls materialised in the
user's backward pass give the exact clipped sum (float64, against micro-batching)."""

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import relative_error
from workbench.dpsgd import MODES, DPOptimizer

CE = nn.CrossEntropyLoss(reduction="none")


class Sequence(nn.Module):
    """Linear layers on (n, T, d): at T = 8 their g_i are smaller than (a, b). ``shared``: the
    head is called again on the mean over positions (n, 4), a call that is not streamed.
    ``seq_first``: the first layer runs on (T, n, d), dim 0 is not the batch."""

    def __init__(self, shared=False, seq_first=False):
        super().__init__()
        self.up, self.down = nn.Linear(3, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.shared, self.seq_first = shared, seq_first

    def forward(self, x):  # (n, T, 3)
        h = self.up(x.transpose(0, 1)).transpose(0, 1) if self.seq_first else self.up(x)
        h = self.down(torch.tanh(h))  # (n, T, 4)
        out = self.head(h).sum(1)  # (n, 2)
        return out + self.head(h.mean(1)) if self.shared else out


def data(n=5, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,),
                                                                                  generator=g)


def dp_step(model, mode, batches, C, skip=False):
    """One step over ``batches`` (two: gradient accumulation); .grad and the streamed calls."""
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.skip_weight_grads = skip
    opt.zero_grad()
    for x, y in batches:
        nn.CrossEntropyLoss(reduction="sum")(model(x), y).backward()
    streamed = sum(c.sampled is not None for c in opt.recorder.layer_rec.all_calls())
    opt.step()
    opt.detach()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, streamed


def expected(model, batches, C):
    sums = [wb.clipped_grad_sum(model, CE, x, y, C, method="microbatch") for x, y in batches]
    return {name: sum(s[name] for s in sums) for name in sums[0]}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [False, True])
def test_streamed_step_is_the_exact_clipped_sum(mode, shared):
    torch.manual_seed(0)
    model = Sequence(shared=shared).double()
    batches = [data()]
    want = expected(model, batches, 0.3)
    got, streamed = dp_step(model, mode, batches, 0.3)
    assert streamed == 3  # up, down and head's (n, T, 4) call: a and b freed in backward
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-10, (mode, name)


def test_accumulated_batches_and_skipped_weight_grads_stay_exact():
    torch.manual_seed(0)
    model = Sequence(shared=True).double()
    batches = [data(5, seed=0), data(3, seed=1)]  # two backward passes: two batches
    want = expected(model, batches, 0.3)
    for skip in (False, True):
        got, streamed = dp_step(model, "bookkeeping", batches, 0.3, skip=skip)
        assert streamed == 6
        for name in want:
            assert relative_error(got[name], want[name]) <= 1e-10, (skip, name)


def test_a_streamed_layer_whose_dim_0_is_not_the_batch_goes_to_the_fallback():
    torch.manual_seed(0)
    model = Sequence(seq_first=True).double()
    batches = [data(n=8, T=8)]  # T == n: the shapes look batch-first
    want = expected(model, batches, 0.3)
    got, streamed = dp_step(model, "bookkeeping", batches, 0.3)
    assert streamed == 0  # time-major rows carry no row tag (flat_rows.unproved): never
    # streamed on (T, n) rows, the fallback's g_i from the start (until 2026-11-30 streamed,
    # then dropped when the self-check found it)
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-10, name


def test_a_second_backward_pass_over_a_streamed_call_is_refused():
    model = Sequence().double()
    x, y = data()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=5.0)
    opt.zero_grad()
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="second backward pass"):
        opt.step()


def test_the_optimizer_step_streams_tiny_gpt():
    """tiny_gpt (b = 16, T = 64), allocated bytes by the CPU profiler (deterministic): one DP
    step in book-keeping over one plain SGD step (zero_grad, forward, backward, step) peaked
    at 1.24x while every layer's (a, b) waited for step(); 1.15x streamed."""
    from workbench.bench.gpt import SIZES, VOCAB
    from workbench.bench.peak_memory import peak_bytes, tensor_bytes
    from workbench.models import sequence_cross_entropy, tiny_gpt

    def make():
        return tiny_gpt(VOCAB, block_size=64, generator=torch.Generator().manual_seed(0),
                        **SIZES["tiny_gpt"])

    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (16, 64), generator=gen) for _ in range(2))
    peaks = []
    for private in (False, True):
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if private:
            opt = DPOptimizer(opt, model, noise_multiplier=1.0, max_grad_norm=1.0,
                              expected_batch_size=16.0, method="bookkeeping")

        def step(model=model, opt=opt):
            opt.zero_grad()
            sequence_cross_entropy(model(x), y).mean().backward()
            opt.step()

        step()  # the first step's self-check runs outside the measurement
        peaks.append(peak_bytes(step, torch.device("cpu"), tensor_bytes(model, x, y)))
    assert peaks[1] <= 1.2 * peaks[0], f"DP step peak {peaks[1] / peaks[0]:.2f}x plain"


class ByBehaviour(nn.Module):
    """Layers whose rules are found by what they compute (``LayerRule.streams``): BiT's
    weight-standardised convolution and normalisation with its activation on images, and
    Gemma's RMSNorm (float64 throughout) on the (n, T, d) sequence the images' rows make."""

    def __init__(self):
        super().__init__()
        from tests.per_sample.test_behaviour_rules import (
            GemmaRMSNorm,
            GroupNormActivation,
            WeightStandardizedConv2d,
        )
        self.conv = WeightStandardizedConv2d(3, 8, 3, 1)
        self.norm = GroupNormActivation(2, 8, nn.ReLU())
        self.rms = GemmaRMSNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # (n, 3, 6, 6)
        h = self.norm(self.conv(x)).flatten(2).transpose(1, 2)  # (n, 36, 8)
        return self.head(self.rms(h)).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_layers_found_by_behaviour_stream_and_stay_exact(mode):
    """Until 2026-12-01 only the exact types of ``bookkeeping.STREAMED`` were materialised in
    the backward pass: these layers kept (a, b) until step() (BiT 2.10x a plain step's peak at
    the table's base size, T5 1.27x)."""
    torch.manual_seed(0)
    model = ByBehaviour().double()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 3, 6, 6, generator=g, dtype=torch.float64),
                torch.randint(0, 2, (5,), generator=g))]
    want = expected(model, batches, 0.3)
    got, streamed = dp_step(model, mode, batches, 0.3)
    assert streamed == 4  # conv, norm, rms and head: a and b freed in the backward pass
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-10, (mode, name)


def test_behaviour_rules_in_chunks_are_the_whole_batchs_rules(monkeypatch):
    """``conv_chunks.in_chunks``: the affine and norm+activation rules over uneven chunks of
    samples give the whole batch's per-sample gradients."""
    from tests.per_sample.test_behaviour_rules import GroupNormActivation, LlamaRMSNorm
    from workbench.rules import conv_chunks
    from workbench.rules.affine import affine_grad_sampler
    from workbench.rules.norm_activation import norm_activation_grad_sampler

    g = torch.Generator().manual_seed(0)
    cases = [(affine_grad_sampler, LlamaRMSNorm(8).double(), (7, 5, 8), (7, 5, 8)),
             (norm_activation_grad_sampler, GroupNormActivation(2, 8, nn.GELU()).double(),
              (7, 8, 3, 3), (7, 8, 3, 3))]
    for rule, layer, a_shape, b_shape in cases:
        with torch.no_grad():
            layer.weight.normal_(generator=g)
        a = torch.randn(a_shape, generator=g, dtype=torch.float64)
        b = torch.randn(b_shape, generator=g, dtype=torch.float64)
        whole = rule(layer, (a,), b)
        monkeypatch.setattr(conv_chunks, "SCRATCH", 3 * a[0].numel() * 4)  # 3 of 7 samples
        chunked = rule(layer, (a,), b)
        monkeypatch.setattr(conv_chunks, "SCRATCH", None)
        assert whole.keys() == chunked.keys()
        for name in whole:
            assert torch.allclose(chunked[name], whole[name], rtol=1e-13, atol=0), name


class LayerScale(nn.Module):
    """A layer scale ``x * gamma`` (Data2Vec-Vision's lambda_1, ConvNeXt's gamma): recorded as
    a ``BroadcastProduct`` call (``per_sample/tied.py``) whose g_i (d numbers) are far smaller
    than its b and x (T d each)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(3, 4)
        self.gamma = nn.Parameter(torch.full((4,), 0.5))
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # (n, T, 3)
        return self.head(torch.tanh(self.up(x)) * self.gamma).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_scale_streams_and_stays_exact(mode):
    torch.manual_seed(0)
    model = LayerScale().double()
    batches = [data()]
    want = expected(model, batches, 0.3)
    got, streamed = dp_step(model, mode, batches, 0.3)
    assert streamed == 3  # up, gamma's product and head (until 2026-12-01: 2)
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-10, (mode, name)
