"""LoRA adapters: the adapted model starts as the base one, only adapters train, and every
per-sample method is exact on them against micro-batching (float64, TOL relative to the
largest entry). Frozen tied head and positional embedding are not sampled, so these hold
with today's engine."""

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.clipping import CLIP_METHODS, NORM_METHODS
from workbench.dpsgd import MODES, DPOptimizer
from workbench.layers import LoRALinear, add_lora, merge_lora
from workbench.models import count_parameters, sequence_cross_entropy, tiny_gpt

TOL = 1e-9


def lora_gpt(random_b=True):
    model = tiny_gpt(11, block_size=8, n_layer=2, n_head=2, n_embd=8,
                     generator=torch.Generator().manual_seed(0)).double()
    add_lora(model, r=2, alpha=4.0, generator=torch.Generator().manual_seed(1))
    if random_b:  # B = 0 at init makes ∂ℓ/∂A = 0: a test on zeros would prove nothing
        g = torch.Generator().manual_seed(2)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                with torch.no_grad():
                    m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g))
    return model


def tokens(n=4, T=6):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (n, T), generator=g), torch.randint(0, 11, (n, T), generator=g)


def max_error(got, ref):
    scale = max(r.abs().max().item() for r in ref.values())
    return max((got[k] - ref[k]).abs().max().item() for k in ref) / scale


def test_starts_as_base_and_only_adapters_train():
    base = tiny_gpt(11, 8, 2, 2, 8, generator=torch.Generator().manual_seed(0))
    x, _ = tokens()
    before = base(x)
    add_lora(base, r=2)
    assert torch.equal(base(x), before)  # B = 0
    trainable = [n for n, p in base.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in trainable)
    assert len(trainable) == 2 * 2 * 6  # 2 layers x (q, k, v, attn.proj, fc, mlp.proj) x (A, B)
    assert count_parameters(base) == 2 * (4 * 2 * (8 + 8) + 2 * (8 + 32) + 2 * (32 + 8))


def test_forward_is_base_plus_scaled_low_rank_and_merges():
    layer = LoRALinear(nn.Linear(5, 3).double(), r=2, alpha=6.0,
                       generator=torch.Generator().manual_seed(0))
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 5, dtype=torch.float64)
    W = layer.base.weight + 3.0 * layer.lora_B.weight @ layer.lora_A.weight  # α / r = 3
    assert torch.allclose(layer(x), x @ W.T + layer.base.bias)
    holder = nn.Sequential(layer)
    expected = holder(x)
    merge_lora(holder)
    assert type(holder[0]) is nn.Linear and torch.allclose(holder(x), expected)


def test_errors():
    with pytest.raises(ValueError, match=r"rank r must be an integer in \[1, min\(d, p\)\]"):
        LoRALinear(nn.Linear(5, 3), r=4)
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match=r"named \['0'\]"):
        add_lora(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("method", ["vmap", "einsum"])
def test_per_sample_gradients_exact(method):
    model, (x, y) = lora_gpt(), tokens()
    ref = wb.per_sample_gradients(model, sequence_cross_entropy, x, y, method="microbatch")
    got = wb.per_sample_gradients(model, sequence_cross_entropy, x, y, method=method)
    assert set(got) == set(ref) and len(ref) == 24 and max_error(got, ref) <= TOL


@pytest.mark.parametrize("method", NORM_METHODS[1:])
def test_norms_exact(method):
    model, (x, y) = lora_gpt(), tokens()
    ref = wb.per_sample_grad_norms(model, sequence_cross_entropy, x, y, method="microbatch")
    got = wb.per_sample_grad_norms(model, sequence_cross_entropy, x, y, method=method)
    assert ((got - ref).abs().max() / ref.max()).item() <= TOL


@pytest.mark.parametrize("method", CLIP_METHODS[1:])
def test_clipped_sum_exact(method):
    model, (x, y) = lora_gpt(), tokens()
    C = float(wb.per_sample_grad_norms(model, sequence_cross_entropy, x, y,
                                       method="microbatch").median())
    ref = wb.clipped_grad_sum(model, sequence_cross_entropy, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(model, sequence_cross_entropy, x, y, C, method=method)
    assert set(got) == set(ref) and max_error(got, ref) <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_dp_optimizer_noiseless_step_is_clipped_sum(mode):
    model, (x, y) = lora_gpt(), tokens()
    C, B = 0.5, 10.0
    ref = wb.clipped_grad_sum(model, sequence_cross_entropy, x, y, C, method="microbatch")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=B, method=mode)
    opt.zero_grad()
    sequence_cross_entropy(model(x), y).mean().backward()
    opt.step()
    opt.detach()
    got = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    assert max_error(got, {k: v / B for k, v in ref.items()}) <= TOL
