"""What a training loop does around the optimizer, on small torch models (float64): the
released sum (σ = 0, B = 1: ``.grad`` is Σ_i c_i g_i) against the batched autograd
reference under the same random state, or a clear error. The Hugging Face versions of these
loops are in ``test_real_loops.py``.

- the loss's reduction over records against ``loss_reduction`` (``record_reduction.py``);
- a loss computed inside the model and returned in a dict (``model_loss.py``);
- randomness drawn under no listed name (``per_sample/uses.py``);
- activation checkpointing (``per_sample/hooks.py``, ``skip_weights.py``);
- an empty Poisson batch the loop does not run through the model (``recorded.py``);
- a resume in the middle of a pass (``sampling.py``).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd import DPOptimizer
from workbench.dpsgd.checkpoint import load_checkpoint, save_checkpoint
from workbench.errors import LossCouplingError, UnsupportedLayerError

D, K, T, C = 6, 4, 5, 0.5


class Net(nn.Module):
    """Tokens (n, T, D) -> (n, T, K); dropout, optional SDPA dropout and checkpointing;
    ``dict_out``: a dict with the logits and, given labels, the mean loss inside."""

    def __init__(self, p=0.2, attention_p=0.0, ckpt=None, dict_out=False):
        super().__init__()
        self.inp, self.fc, self.qkv = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, K)
        self.drop, self.attention_p, self.ckpt, self.dict_out = nn.Dropout(p), attention_p, \
            ckpt, dict_out

    def block(self, h):
        q, k, v = self.qkv(h).chunk(3, -1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_p
                                           if self.training else 0.0)
        return self.drop(torch.tanh(self.fc(h + a)))

    def forward(self, x, labels=None):
        h = self.inp(x)  # requires grad: a reentrant checkpoint passes gradients on then
        h = self.block(h) if self.ckpt is None else checkpoint(self.block, h,
                                                               use_reentrant=self.ckpt)
        logits = self.head(h)
        if not self.dict_out:
            return logits
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, K), labels.reshape(-1),
                                          ignore_index=-100)
        return out


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (n, T), generator=g)
    y[1:, -2:] = -100  # padding on every record but the first
    return x, y


def token_mean(logits, y):
    """(n,) each record's own mean over its non-ignored positions."""
    valid = y != -100
    ce = F.cross_entropy(logits.transpose(1, 2), y.clamp(min=0), reduction="none")
    return (ce * valid).sum(1) / valid.sum(1)


def reference(twin, x, y, record_loss=token_mean):
    """Σ_i clip_C(g_i) from one batched forward pass of ``twin`` (the caller's RNG state)."""
    out = twin(x)
    losses = record_loss(out["logits"] if isinstance(out, dict) else out, y)
    params = list(twin.parameters())
    total = 0
    for i in range(x.shape[0]):
        g = torch.cat([t.flatten() for t in torch.autograd.grad(losses[i], params,
                                                                retain_graph=True)])
        total = total + min(1.0, C / float(g.norm())) * g
    return total


def released(model, loop, steps=(3, T), mode="einsum", reduction="mean",
             record_loss=token_mean, check=True):
    """The loop ``loop(model, x, y)`` (forward and backward) over several steps; asserts each
    step's released sum equals the reference (``check``; a loop the engine refuses needs
    none)."""
    torch.manual_seed(0)
    model = model.double().train()
    twin = copy.deepcopy(model)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction=reduction)
    try:
        for s, n in enumerate(steps):
            x, y = data(n, seed=s)
            twin.load_state_dict(model.state_dict())
            state = torch.get_rng_state()
            want = reference(twin, x, y, record_loss) if check else None
            torch.set_rng_state(state)
            opt.zero_grad()
            loop(model, x, y)
            opt.step()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            assert not check or float((got - want).norm()) <= 1e-9 * float(want.norm()), \
                (s, n, mode)
    finally:
        opt.detach()


def summed_tokens(logits, y):
    valid = y != -100
    ce = F.cross_entropy(logits.transpose(1, 2), y.clamp(min=0), reduction="none")
    return (ce * valid).sum(1)


# --- the loss's reduction over records ------------------------------------------------------

def functional_sum(model, x, y):
    F.cross_entropy(model(x).reshape(-1, K), y.reshape(-1), reduction="sum").backward()


def per_record_sum(model, x, y):
    summed_tokens(model(x), y).sum().backward()


@pytest.mark.parametrize("loop", [functional_sum, per_record_sum])
def test_a_sum_under_loss_reduction_mean_is_refused(loop):
    """Under "mean" the engine multiplies g_i by n: a loss that sums its records would
    release clip(n ∇ℓ_i), n a statistic of the batch (silently, before)."""
    with pytest.raises(LossCouplingError, match="sums the records' terms"):
        released(Net(), loop, steps=(3,))


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("loop", [functional_sum, per_record_sum])
def test_a_sum_under_loss_reduction_sum_is_exact(loop, mode):
    released(Net(), loop, mode=mode, reduction="sum", record_loss=summed_tokens)


def test_a_sum_divided_by_n_is_the_mean():
    def loop(model, x, y):
        (summed_tokens(model(x), y).sum() / x.shape[0]).backward()

    released(Net(), loop, record_loss=summed_tokens)


def test_a_sum_divided_by_a_constant_under_mean_is_refused_when_n_differs():
    def loop(model, x, y):  # B = 3: n = 3 passes (it is n), n = 5 is refused
        (summed_tokens(model(x), y).sum() / 3.0).backward()

    with pytest.raises(LossCouplingError, match="sums the records' terms"):
        released(Net(), loop, steps=(3, T), record_loss=summed_tokens)


def test_a_mean_under_loss_reduction_sum_is_refused():
    def loop(model, x, y):
        token_mean(model(x), y).mean().backward()

    with pytest.raises(LossCouplingError, match="averages the records' terms"):
        released(Net(), loop, steps=(3,), reduction="sum")


def test_a_sum_plus_a_mean_is_refused():
    def loop(model, x, y):
        out = model(x)
        (token_mean(out, y).mean() + 0.1 * out.pow(2).sum()).backward()

    with pytest.raises(LossCouplingError, match="sum the records to terms that average"):
        released(Net(), loop, steps=(3,))


# --- a loss inside the model, a dict output -------------------------------------------------

@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_the_models_own_loss_in_a_dict_is_each_records_own_mean(mode):
    """``out = model(x, labels=y); out["loss"].backward()``: the mean over the batch's
    non-ignored positions, computed inside forward; record i's own mean is released."""
    released(Net(dict_out=True), lambda m, x, y: m(x, labels=y)["loss"].backward(), mode=mode)


def test_a_loss_inside_the_model_divided_by_a_count_is_refused():
    class Counted(Net):
        def forward(self, x, labels=None):
            logits = super().forward(x)["logits"]
            total = F.cross_entropy(logits.reshape(-1, K), labels.reshape(-1), reduction="sum")
            return {"logits": logits, "loss": total / (labels != -100).sum()}

    with pytest.raises(LossCouplingError, match=r"out\['loss'\]"):
        released(Counted(dict_out=True), lambda m, x, y: m(x, labels=y)["loss"].backward(),
                 steps=(3,), check=False)


def test_a_model_returning_only_its_loss_is_refused():
    class LossOnly(Net):
        def forward(self, x, labels=None):
            return super().forward(x, labels)["loss"]

    with pytest.raises(LossCouplingError, match="returned only scalars"):
        released(LossOnly(dict_out=True), lambda m, x, y: m(x, labels=y).backward(),
                 steps=(3,), check=False)


# --- randomness, checkpointing --------------------------------------------------------------

def test_dropout_drawn_inside_sdpa_is_replayed():
    """SDPA's dropout_p is the model's only randomness: found by the generators' states."""
    released(Net(p=0.0, attention_p=0.3),
             lambda m, x, y: token_mean(m(x), y).mean().backward())


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_non_reentrant_checkpointing_is_exact_every_step(mode):
    """The block's forward runs again in backward (not recorded); the default skips the
    weight gradients from the second step, but not under the checkpoint's hooks."""
    released(Net(ckpt=False), lambda m, x, y: token_mean(m(x), y).mean().backward(),
             mode=mode)


def test_reentrant_checkpointing_is_refused():
    with pytest.raises(UnsupportedLayerError, match="use_reentrant=True"):
        released(Net(ckpt=True), lambda m, x, y: token_mean(m(x), y).mean().backward(),
                 steps=(3,), check=False)


# --- the engine's loader: an empty batch, a resume ------------------------------------------

def engine_run(steps, resume_from=None, save_at=None, path=None, seed=0):
    """make_private over 12 records (q = 1/4); each step's .grad, from step ``start``."""
    torch.manual_seed(seed)
    model = Net(p=0.3).double().train()
    x, y = data(12, seed=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = wb.PrivacyEngine()
    noise, sampling = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    model, opt, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y),
                                                                  batch_size=3),
        noise_multiplier=0.5, max_grad_norm=C, noise_generator=noise,
        sampling_generator=sampling)
    step, grads, empty = 0, [], 0
    if resume_from is not None:
        load_checkpoint(resume_from, model=model, optimizer=opt, engine=engine,
                        noise_generator=noise, sampling_generator=sampling)
        step = save_at
    while step < steps:
        for xb, yb in loader:
            opt.zero_grad()
            if len(xb):  # an empty batch is not run through the model: step anyway
                token_mean(model(xb), yb).mean().backward()
            else:
                empty += 1
            opt.step()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            step += 1
            if step == save_at and resume_from is None:
                save_checkpoint(path, model=model, optimizer=opt, engine=engine,
                                noise_generator=noise, sampling_generator=sampling)
                return grads, empty
            if step == steps:
                break
    return grads, empty


def test_an_empty_batch_steps_without_a_forward_pass():
    """Σ_i c_i g_i = 0 and the noise is added: the step must happen (skipping it would tell
    that the batch was empty), and a model that cannot take n = 0 need not see it."""
    grads, empty = engine_run(24)
    assert empty > 0 and len(grads) == 24


def test_a_resume_in_the_middle_of_a_pass_continues_bit_for_bit(tmp_path):
    """The pass begun after the resume draws its workers' base seed from the loader's own
    generator, not the global one that the dropout masks come from."""
    path = tmp_path / "run.pt"
    full, _ = engine_run(6)
    engine_run(6, save_at=2, path=path)  # step 2 is inside the first pass (4 batches)
    rest, _ = engine_run(6, resume_from=path, save_at=2, seed=123)
    assert len(rest) == 4
    for a, b in zip(full[2:], rest):
        assert torch.equal(a, b)


# --- an output the other outputs are computed from ------------------------------------------

class TwoOut(nn.Module):
    """(logits, h): logits computed from h (T5's encoder_last_hidden_state, hidden_states)."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return self.dec(h), h


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "microbatch", "vmap"])
def test_an_upstream_output_is_not_counted_twice(mode):
    """h's recorded gradient holds what flows through the logits: it is no recorded output
    (the self-check refused every mode before)."""
    released(TwoOut(), lambda m, x, y: token_mean(m(x)[0], y).mean().backward(), mode=mode,
             record_loss=lambda out, y: token_mean(out[0], y))


def test_a_loss_reading_an_upstream_output_is_refused():
    def loop(model, x, y):
        logits, h = model(x)
        (token_mean(logits, y).mean() + h.pow(2).mean()).backward()

    with pytest.raises(LossCouplingError, match=r"reads out\[1\]"):
        released(TwoOut(), loop, steps=(3,), check=False)


# --- gradient accumulation ------------------------------------------------------------------

def test_accumulation_with_a_one_record_micro_batch_is_exact():
    """Two backward passes before one step, of 1 and 2 records (a Poisson batch of 3 split in
    two): each record clipped on its own, as for one batch of 3. The .grad check compares
    the sum of both passes' path gradients, the unchecked one-record pass's included (was a
    false UnattributedGradientError)."""
    def loop(model, x, y):
        for part in (slice(0, 1), slice(1, 3)):
            (token_mean(model(x[part]), y[part]).mean() / 2).backward()

    released(Net(p=0.0), loop, steps=(3,), record_loss=lambda out, y: token_mean(out, y) / 2)


@pytest.mark.parametrize("method", ["microbatch", "einsum", "ghost", "bookkeeping"])
def test_reentrant_checkpointing_is_refused_by_the_functional_api_too(method):
    """The same error as the optimizer's, not PyTorch's bare RuntimeError from the nested
    torch.autograd.grad (2026-11-30: a real Llama with gradient checkpointing,
    use_reentrant=True)."""
    model = Net(ckpt=True).double().train()
    x, y = data(4, seed=3)
    loss = lambda out, t: token_mean(out, t)  # noqa: E731
    with pytest.raises(UnsupportedLayerError, match="use_reentrant=False"):
        if method in ("microbatch", "einsum"):
            wb.per_sample_gradients(model, loss, x, y, method=method)
        else:
            wb.clipped_grad_sum(model, loss, x, y, 1.0, method=method)


@pytest.mark.parametrize("vector", [False, True], ids=["", "the records' losses reduced late"])
@pytest.mark.parametrize("evaluate", [False, True], ids=["", "an evaluation between"])
@pytest.mark.parametrize("poisson", [True, False], ids=["Poisson", "shuffled"])
def test_zero_grad_between_forward_and_backward_is_the_same_step(poisson, evaluate, vector):
    """``loss = crit(model(x), y); opt.zero_grad(); loss.backward(); opt.step()``, the order
    of PyTorch's own tutorials: zero_grad dropped the recorded forward pass, and step()
    refused "without a backward()" until 2026-11-30. Now the same update as zero_grad first;
    also where the loop holds the records' losses and reduces them after zero_grad (refused
    the same way until 2026-12-01)."""
    import warnings

    def run(late):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K)).double()
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(24, D, dtype=torch.float64, generator=g),
                             torch.randint(0, K, (24,), generator=g))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = wb.PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=DataLoader(data, batch_size=6, shuffle=not poisson,
                                       generator=torch.Generator().manual_seed(2)),
                noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=poisson,
                sampling_generator=torch.Generator().manual_seed(3))
        for x, y in loader:
            if not late:
                opt.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction="none" if vector else "mean")
            if evaluate:
                with torch.no_grad():
                    model(x[:2])
            if late:
                opt.zero_grad()
            (loss.mean() if vector else loss).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(late=True), run(late=False)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
