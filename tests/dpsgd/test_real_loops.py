"""Real users' training loops on real Hugging Face models, in ``.train()`` with their default
dropout: the released sum (σ = 0: ``.grad`` after ``step()`` is Σ_i c_i g_i / B) against an
independent reference, or a clear error naming the loss term or layer and the fix.

The reference: per-record losses ℓ_i from ONE batched forward pass of a twin of the model
under the same random state (the same dropout masks), g_i = ∂ℓ_i/∂θ by
``torch.autograd.grad`` each (valid because the records do not mix), clipped and summed
here. ℓ_i is record i's own loss: the mean over its own non-padding tokens (``labels`` -100
on padding) for the token-level losses, its cross-entropy for the classifiers. Several steps
with Poisson-like sizes n = 3, 5 (T = 5 tokens: n = T is the layout shapes cannot tell
apart). Hugging Face's loss upcasts the logits to float32: those loops compare to 1e-5.

Families covered (``dpsgd/model_loss.py``, ``record_reduction.py``, ``per_sample/uses.py``,
``per_sample/hooks.py``, ``skip_weights.py``): the HF way ``model(**batch).loss.backward()``
(a ``ModelOutput``, a loss inside the model normalised by the batch's token count), a
seq2seq model returning an output its logits are computed from, attention dropout drawn
inside SDPA (Llama's only dropout), activation checkpointing (``use_reentrant=False``
exact, ``True`` refused), ViT's embeddings on the exact fallback with a keyword call, and a
summed loss under ``loss_reduction="mean"`` (refused).
"""

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F

from workbench.dpsgd import DPOptimizer
from workbench.errors import LossCouplingError, UnsupportedLayerError

pytestmark = pytest.mark.realmodels

V, T, K, B = 32, 5, 3, 4.0
STEPS = (3, T)  # n != T, then n = T


@pytest.fixture(autouse=True)
def libraries():
    for name in ("transformers", "peft"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed: pip install '.[realmodels]'")


def hf():
    from workbench.realzoo.imports import import_transformers
    return import_transformers()


def gpt2():
    t = hf()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2,
                                          n_positions=16, bos_token_id=1, eos_token_id=1))


def llama():  # no dropout but the attention's, drawn inside scaled_dot_product_attention
    t = hf()
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=16, head_dim=8,
        attention_dropout=0.3))


def bert():
    t = hf()
    return t.BertForSequenceClassification(t.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=K))


def t5():
    t = hf()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0))


def vit():
    t = hf()
    return t.ViTForImageClassification(t.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=K, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1))


def batch(kind, n, seed):
    """A collator's dict batch: right padding, labels -100 on padding (record 0 unpadded)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64),
                "labels": torch.randint(0, K, (n,), generator=g)}
    ids = torch.randint(2, V, (n, T), generator=g)
    lengths = torch.randint(2, T + 1, (n,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = ids * mask
    if kind == "classify":
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(0, K, (n,), generator=g)}
    labels = torch.where(mask.bool(), ids, -100)
    if kind == "seq2seq":  # targets of other lengths; the decoder reads them shifted
        labels = torch.where(torch.arange(T)[None] < lengths.flip(0)[:, None],
                             torch.randint(2, V, (n, T), generator=g), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def own_losses(kind, logits, labels):
    """(n,) ℓ_i: record i's own loss (module docstring)."""
    if kind in ("classify", "image"):
        return F.cross_entropy(logits, labels, reduction="none")
    if kind == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    valid = labels != -100
    ce = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (ce * valid).sum(1) / valid.sum(1)


def reference(twin, kind, b, call):
    """[g_i] (flat) from one batched forward pass of ``twin`` (the same random state)."""
    losses = own_losses(kind, call(twin, b).logits, b["labels"])
    params = [p for p in twin.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
            for i in range(losses.shape[0])]
    return [torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                       for p, g in zip(params, r)]) for r in rows]


def hf_way(model, b):
    return model(**b)


def without_labels(model, b):
    return model(**{k: v for k, v in b.items() if k != "labels"})


def run(build, kind, mode, loss_of=None, call=hf_way, prepare=None, rtol=1e-5,
        steps=STEPS, **kw):
    """Each step: the reference on a twin under the random state, then the user's loop;
    ``loss_of(out, b)``: the loop's loss (default: ``out.loss``)."""
    torch.manual_seed(0)
    model = build().double().train()
    twin = copy.deepcopy(model)
    if prepare is not None:
        prepare(model)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=B, method=mode, **kw)
    try:
        for s, n in enumerate(steps):
            b = batch(kind, n, seed=10 + s)
            twin.load_state_dict(model.state_dict())
            state = torch.get_rng_state()
            rows = reference(twin, kind, b, call)
            torch.set_rng_state(state)  # the loop draws the reference's masks
            C = float(torch.stack([r.norm() for r in rows]).median())
            want = sum(min(1.0, C / float(r.norm())) * r for r in rows) / B  # Σ_i c_i g_i / B
            opt.max_grad_norm = C
            opt.zero_grad()
            out = call(model, b)
            (out.loss if loss_of is None else loss_of(out, b)).backward()
            opt.step()
            got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
            err = float((got - want).norm()) / float(want.norm())
            assert err <= rtol, f"step {s} (n = {n}, {mode}): relative error {err:.2e}"
    finally:
        opt.detach()


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_gpt2_the_hf_way_with_dropout_and_padding(mode):
    """``model(**batch).loss.backward()``: a ModelOutput, the loss computed inside the model
    as the mean over the whole batch's non-padding tokens; each record's own mean is
    released (the loss's factors D / N_i, ``per_sample/loss.py``), with GPT-2's three
    dropouts on."""
    quiet(run, gpt2, "causal", mode)


def token_mean(out, b):
    logits, labels = out.logits[:, :-1], b["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)


def test_llama_attention_dropout_inside_sdpa():
    """Llama draws its only dropout inside scaled_dot_product_attention (dropout_p): the
    forward pass is random though no listed random function ran; the generators' states tell
    (``per_sample/uses.py``), so the self-check replays the masks (it refused before)."""
    quiet(run, llama, "causal", "einsum", loss_of=token_mean, call=without_labels)


def test_t5_the_hf_way_with_its_encoder_output():
    """T5 returns encoder_last_hidden_state, which its logits are computed from: it is no
    recorded output (its gradient holds the decoder's), so the exact checks count nothing
    twice (they refused before); the loss inside the model is attributed per record."""
    quiet(run, t5, "seq2seq", "einsum")


def test_t5_loss_reading_the_encoder_output_is_refused():
    def loss(out, b):
        return out.loss + out.encoder_last_hidden_state.pow(2).mean()

    with pytest.raises(LossCouplingError, match="encoder_last_hidden_state"):
        quiet(run, t5, "seq2seq", "einsum", loss_of=loss, steps=(3,))


def test_vit_train_mode_embeddings_on_the_replayed_fallback():
    """ViT's cls_token and position_embeddings need the exact fallback (its embeddings hold a
    dropout and no rule); the model is called with keywords (pixel_values=, labels=), which
    the fallback now replays (it refused every keyword call before)."""
    quiet(run, vit, "image", "einsum", steps=(3,))


def checkpointed(model):
    model.gradient_checkpointing_enable()  # Hugging Face's default: use_reentrant=False


def test_bert_gradient_checkpointing_from_the_second_step():
    """The forward of each layer runs again in the backward pass: those calls are not the
    batch's (``per_sample/hooks.py``), and from the second step, where the default skips the
    weight gradients, nothing is skipped under the checkpoint's saved-tensor hooks (its
    recomputation met other saved tensors and raised CheckpointError before)."""
    quiet(run, bert, "classify", "bookkeeping", steps=(3, T, 4))


def test_reentrant_checkpointing_is_refused():
    def reentrant(model):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": True})

    with pytest.raises(UnsupportedLayerError, match="use_reentrant=False"):
        quiet(run, bert, "classify", "einsum", prepare=reentrant, steps=(3,))


def test_a_summed_loss_under_the_default_mean_is_refused():
    """F.cross_entropy(..., reduction="sum") with loss_reduction="mean": each g_i would be
    multiplied by n (silently, before ``record_reduction.py``); with loss_reduction="sum"
    the same loop is exact."""
    def summed(out, b):
        logits, labels = out.logits[:, :-1], b["labels"][:, 1:]
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum")

    with pytest.raises(LossCouplingError, match="sums the records' terms"):
        quiet(run, gpt2, "causal", "einsum", loss_of=summed, call=without_labels, steps=(3,))
