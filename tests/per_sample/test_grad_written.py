"""A parameter whose gradient reaches it other than through the graph's edges is refused by
name in every method of the functional API (``per_sample/hooks.refusing_reentrant``): a
custom ``autograd.Function`` whose backward calls ``torch.autograd.backward`` itself writes
the parameters' ``.grad`` directly (Hugging Face Reformer's ``_ReversibleFunction``); every
method left their per-sample rows exactly zero (Reformer: the clipped sum 2% off, no error,
until 2026-11-30). The model's ``.grad`` fields are left as they were, refused or not."""

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.clipping import CLIP_METHODS, NORM_METHODS
from workbench.errors import UnsupportedLayerError
from workbench.per_sample import METHODS

N, D, K = 6, 4, 3


class WritesGrad(torch.autograd.Function):
    """y = layer(x); its backward reruns the layer and calls torch.autograd.backward, which
    accumulates the layer's parameter gradients into .grad (no edge to them)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        return layer(x).detach()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.layer(x), g)
        return x.grad, None


class Net(nn.Module):
    def __init__(self, write=True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.inner, self.b = nn.Linear(D, 5), nn.Linear(5, 5), nn.Linear(5, K)
        self.write = write
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(WritesGrad.apply(h, self.inner) if self.write else self.inner(h))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=g, dtype=torch.float64), torch.arange(N) % K


LOSS = nn.CrossEntropyLoss(reduction="none")
CALLS = ([("per_sample_gradients", m) for m in METHODS]
         + [("per_sample_grad_norms", m) for m in NORM_METHODS]
         + [("clipped_grad_sum", m) for m in CLIP_METHODS])


def call(fn, method, model, x, y):
    args = (1.0,) if fn == "clipped_grad_sum" else ()
    return getattr(wb, fn)(model, LOSS, x, y, *args, method=method)


@pytest.mark.parametrize("fn,method", CALLS)
def test_a_gradient_written_into_grad_inside_backward_is_refused_by_name(fn, method):
    model = Net()
    x, y = batch()
    sentinel = {k: torch.full_like(p, 7.0) for k, p in model.named_parameters()}
    for k, p in model.named_parameters():
        p.grad = sentinel[k]
    with pytest.raises(UnsupportedLayerError) as info:
        call(fn, method, model, x, y)
    if method != "vmap":  # vmap refuses the Function itself (no setup_context), by name
        assert "'inner.weight', 'inner.bias' received gradient by a write into .grad" in str(
            info.value)
        assert "use_reentrant=False" in str(info.value)
    for k, p in model.named_parameters():  # left as they were
        assert p.grad is sentinel[k] and bool((p.grad == 7.0).all())


@pytest.mark.parametrize("fn,method", CALLS)
def test_the_same_model_through_the_graph_is_exact_and_its_grad_kept(fn, method):
    """The control: the layer called through the graph; every method against a loop over the
    records (float64, rtol 1e-10), the .grad fields untouched."""
    model = Net(write=False)
    x, y = batch()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    kept = [p.grad for p in model.parameters()]
    names = [k for k, _ in model.named_parameters()]
    rows = [torch.autograd.grad(LOSS(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                list(model.parameters())) for i in range(N)]
    got = call(fn, method, model, x, y)
    if fn == "per_sample_gradients":
        for j, k in enumerate(names):
            torch.testing.assert_close(got[k], torch.stack([r[j] for r in rows]),
                                       rtol=1e-10, atol=1e-12)
    else:
        norms = torch.stack([torch.cat([g.flatten() for g in r]).norm() for r in rows])
        if fn == "per_sample_grad_norms":
            torch.testing.assert_close(got.double(), norms, rtol=1e-10, atol=1e-12)
        else:
            c = (1.0 / norms).clamp(max=1.0)
            for j, k in enumerate(names):
                want = sum(c[i] * rows[i][j] for i in range(N))
                torch.testing.assert_close(got[k], want, rtol=1e-10, atol=1e-12)
    assert all(p.grad is g and bool((g == 1).all()) for p, g in zip(model.parameters(), kept))


@pytest.mark.realmodels
@pytest.mark.slow
def test_hugging_face_reformer_in_train_mode_is_refused_by_name():
    """probeM reformer_repro: Reformer's reversible layers write .grad in their backward;
    microbatch and bookkeeping returned zero rows for those parameters (2% off overall)."""
    pytest.importorskip("transformers")
    from workbench.realzoo.imports import import_transformers
    tr = import_transformers()
    config = tr.ReformerConfig(
        vocab_size=16, hidden_size=16, attn_layers=["local", "lsh"], axial_pos_shape=(2, 4),
        axial_pos_embds_dim=(8, 8), feed_forward_size=32, num_attention_heads=2,
        attention_head_size=8, max_position_embeddings=8, lsh_attn_chunk_length=4,
        local_attn_chunk_length=4, num_buckets=2, num_hashes=1, hash_seed=0, is_decoder=True,
        hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0, axial_pos_embds=True)
    torch.manual_seed(0)
    hf = tr.ReformerModelWithLMHead(config).double().train()

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(input_ids=ids).logits

    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(2, 16, (3, 8), generator=g), torch.randint(0, 16, (3, 8), generator=g)

    def lm_loss(out, t):
        return nn.functional.cross_entropy(out.transpose(1, 2), t, reduction="none").sum(1)

    model = LM()
    for fn, method in [("per_sample_gradients", "microbatch"),
                       ("clipped_grad_sum", "bookkeeping")]:
        args = (1e-3,) if fn == "clipped_grad_sum" else ()
        with pytest.raises(UnsupportedLayerError,
                           match=r"'hf\.reformer\.encoder\.layers\.0\.attention.*received "
                                 r"gradient by a write into \.grad"):
            getattr(wb, fn)(model, lm_loss, ids, y, *args, method=method)
        assert all(p.grad is None for p in model.parameters())
