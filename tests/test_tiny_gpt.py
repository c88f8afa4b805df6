"""tiny_gpt: shapes, causality, tied head, and every per-sample method against micro-batching.

Exactness is checked in float64 with one tolerance, TOL = 1e-9, relative to the largest
per-sample gradient entry of the whole model (not of each parameter): the attention key bias
has a true gradient of exactly 0 (adding q·b_k to every score of a row leaves the softmax
unchanged), so a per-parameter scale would compare rounding noise (~1e-17) with itself.
"""

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.clipping import CLIP_METHODS, NORM_METHODS
from workbench.dpsgd import MODES, DPOptimizer
from workbench.lm.gpt import generate
from workbench.models import count_parameters, sequence_cross_entropy, tiny_gpt

TOL = 1e-9


def small_model():
    model = tiny_gpt(11, block_size=8, n_layer=2, n_head=2, n_embd=8,
                     generator=torch.Generator().manual_seed(0))
    return model.double()


def tokens(n=4, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (n, T), generator=g)  # (n, T)
    return x, torch.randint(0, 11, (n, T), generator=g)  # (n, T)


def max_error(got: dict, ref: dict) -> float:
    scale = max(r.abs().max().item() for r in ref.values())
    return max((got[k] - ref[k]).abs().max().item() for k in ref) / scale


def test_shapes_count_and_tied_head():
    model = tiny_gpt(96, generator=torch.Generator().manual_seed(0))
    assert count_parameters(model) == 114_432
    assert model.wte.weight is dict(model.named_parameters())["wte.weight"]
    x = torch.randint(0, 96, (3, 17))
    assert model(x).shape == (3, 17, 96)
    logits = model(x)
    h = model.ln_f(model.h[1](model.h[0](model.wte(x) + model.wpe(torch.arange(17)))))
    assert torch.allclose(logits, h @ model.wte.weight.T, atol=1e-6)  # the head is Eᵀ


def test_causal_prefix_does_not_see_future():
    model = small_model()
    x, _ = tokens()
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    assert torch.equal(model(x)[:, :-1], model(changed)[:, :-1])
    assert not torch.equal(model(x)[:, -1], model(changed)[:, -1])


def test_initialisation_is_reproducible_from_generator():
    a = tiny_gpt(11, 8, 1, 2, 8, generator=torch.Generator().manual_seed(3))
    b = tiny_gpt(11, 8, 1, 2, 8, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.all(a.h[0].attn.query.bias == 0) and torch.all(a.ln_f.weight == 1)
    assert a.h[0].mlp.proj.weight.std() < a.h[0].mlp.fc.weight.std()  # 0.02 / √(2L)


def test_sequence_loss_means_and_sums_over_tokens():
    logits, y = torch.randn(2, 5, 7, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    assert torch.allclose(sequence_cross_entropy(logits, y), per_token.mean(1))
    assert torch.allclose(sequence_cross_entropy(logits, y, reduction="sum"), per_token.sum(1))
    with pytest.raises(ValueError, match="reduction"):
        sequence_cross_entropy(logits, y, reduction="none")


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="n_embd=10 must be divisible by n_head=4"):
        tiny_gpt(11, n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        tiny_gpt(11, n_layer=0)
    with pytest.raises(ValueError, match="T=9 exceeds block_size=8"):
        small_model()(torch.zeros(1, 9, dtype=torch.long))


def test_generate_extends_prompt_reproducibly():
    model = small_model()
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(model, prompt, 12, generator=torch.Generator().manual_seed(0))
    b = generate(model, prompt, 12, generator=torch.Generator().manual_seed(0))
    assert a.shape == (1, 15) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    greedy = generate(model, prompt, 1, top_k=1)
    assert greedy[0, -1] == model(prompt)[0, -1].argmax()
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 1, temperature=0)


@pytest.mark.parametrize("method", ["vmap", "einsum"])
def test_per_sample_gradients_exact(method):
    model, (x, y) = small_model(), tokens()
    ref = wb.per_sample_gradients(model, sequence_cross_entropy, x, y, method="microbatch")
    got = wb.per_sample_gradients(model, sequence_cross_entropy, x, y, method=method)
    assert set(got) == set(ref) and max_error(got, ref) <= TOL


@pytest.mark.parametrize("method", NORM_METHODS[1:])
def test_per_sample_grad_norms_exact(method):
    model, (x, y) = small_model(), tokens()
    ref = wb.per_sample_grad_norms(model, sequence_cross_entropy, x, y, method="microbatch")
    got = wb.per_sample_grad_norms(model, sequence_cross_entropy, x, y, method=method)
    assert ((got - ref).abs().max() / ref.max()).item() <= TOL


@pytest.mark.parametrize("method", CLIP_METHODS[1:])
def test_clipped_grad_sum_exact(method):
    model, (x, y) = small_model(), tokens()
    norms = wb.per_sample_grad_norms(model, sequence_cross_entropy, x, y, method="microbatch")
    C = float(norms.median())  # some samples clipped, some not
    ref = wb.clipped_grad_sum(model, sequence_cross_entropy, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(model, sequence_cross_entropy, x, y, C, method=method)
    assert set(got) == set(ref) and max_error(got, ref) <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_dp_optimizer_noiseless_step_is_clipped_sum(mode):
    """The optimizer sees only layer calls, so even its microbatch/vmap modes need issue 13."""
    model, (x, y) = small_model(), tokens()
    C, B = 0.5, 10.0
    ref = wb.clipped_grad_sum(model, sequence_cross_entropy, x, y, C, method="microbatch")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=B, method=mode)
    opt.zero_grad()
    sequence_cross_entropy(model(x), y).mean().backward()
    opt.step()
    opt.detach()
    got = {k: p.grad for k, p in model.named_parameters()}
    assert max_error(got, {k: v / B for k, v in ref.items()}) <= TOL


@pytest.mark.parametrize("n", [4, 6])  # n = T = 6: positions look batch-first by shape
def test_tied_head_and_positions_are_rule_calls_not_the_fallback(n):
    """The tied head F.linear(h, E) is a Linear call on E and wpe(arange(T)) is recorded where
    it meets the batch: no parameter needs the whole-model fallback (the speed of issue 18)."""
    from workbench.clipping.ghost import record
    model, (x, y) = small_model(), tokens(n=n)
    rec = record(model, sequence_cross_entropy, x, y, retain_graph=False, check="always")
    assert rec.fallback_names() == [] and "F.linear(wte.weight)" in rec.layers
    wpe = [call for path, _, call in rec.calls() if path == "wpe"]
    assert len(wpe) == 1 and wpe[0].backprops.shape == (n, 6, 8)  # (n, T, C) per sample
    assert id(model.wte.weight) in rec.shared_ids()  # summed over both uses before the norm
