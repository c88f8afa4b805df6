"""The real-architecture table (``workbench.realzoo``): every method of the functional API and
every DP-optimizer mode, two calls / several steps each, n ≠ T and n = T, against an
independent float64 one-sample-at-a-time loop (``torch.autograd.grad`` per sample, written
here, not the library's micro-batching): exact, or a clear error (``REFUSED``).

Needs the ``realmodels`` extra (``make test`` installs it; in CI a skip for a missing library
is a failure, ``tests/conftest.py``). By default a subset covering each rule family runs;
with ``CI`` or ``WORKBENCH_REAL_ALL=1`` set, every architecture.
"""

import functools
import importlib.util
import os
import warnings

import pytest
import torch

import workbench as wb
from workbench.dpsgd import MODES, DPOptimizer
from workbench.errors import WorkbenchError
from workbench.realzoo import PROBLEMS, REFUSED
from workbench.realzoo.reference import clipped_sum, error, norms_of, one_at_a_time, scale

pytestmark = pytest.mark.realmodels

T = 5  # tokens per sequence; n = T is the layout shapes cannot tell apart
ALL = bool(os.environ.get("CI") or os.environ.get("WORKBENCH_REAL_ALL"))
SUBSET = ["gpt2", "llama", "opt", "bloom", "t5", "mpnet", "lora_llama", "loha_bert",
          "timm_convnext", "timm_resnet_bn"]  # Conv1D, RMSNorm, flattened MLP, vmap refused,
# T5, MPNet's bias expanded to the batch (silently wrong at n = T in every optimizer mode
# before the probe compared treatments and the check compared each parameter), LoRA, a
# parameter only an autograd.Function uses, LN2d, BN
NAMES = list(PROBLEMS) if ALL else SUBSET
IMAGE = {name for name, p in PROBLEMS.items() if p.kind == "image"}
# the layers still on per-layer vmap (ghost_routes) and why; any other is a regression
VMAP_ROUTES: dict[str, set] = {}
# (Mixtral's router and experts have no rule of their own; the router's F.linear on the
# flattened tokens and the experts' W[expert_ids] picks are recorded as calls of a Linear and
# of a ParameterRows layer inside their owners, per_sample/tied.py, rules/gather.py: until
# then they took per-layer vmap over each sample's rows)
# (Mamba's and Mamba-2's mixers and DoRA's magnitude layer left vmap: A_log, D, dt_bias and
# DoRA's m reach the loss only through tensors computed from them that meet the batch,
# -exp(A_log) ⊙ Δ, x ⊙ D, m / ||W + s BA||_c ⊙ ..., which per_sample/derived.py
# differentiates at each meeting)

@pytest.fixture(autouse=True)
def libraries():
    for name in ("transformers", "timm", "peft", "torchvision"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed: pip install '.[realmodels]'")

def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)

@functools.lru_cache(maxsize=None)
def model_of(name):
    return quiet(PROBLEMS[name].build)

def batches(name):
    """Two batches per size: n ≠ T, then n = T (images: two sizes)."""
    sizes = (2, 3) if name in IMAGE else (3, T)
    return [PROBLEMS[name].batch(n, T=T, seed=s) for n in sizes for s in (0, 1)]

def assert_close(got, want, size, what, rtol):  # rtol: the problem's (FLOAT32_INSIDE)
    assert error(got, want, size, rtol) <= 1, f"{what}: error {float((got - want).norm()):.2e}"

def step_matches(opt, forward, loss_fn, x, y, ref, params, what, rtol):
    """One DP-optimizer step (no noise, B = 4) at the median norm of ``ref`` (the one-record
    loop's g_i) gives each trainable parameter the clipped sum of ``ref``."""
    opt.max_grad_norm = C = float(norms_of(ref).median())
    want = clipped_sum(ref, C)
    opt.zero_grad()
    loss_fn(forward(x), y).sum().backward()
    quiet(opt.step)
    for k, p in params.items():
        if p.requires_grad:
            assert_close(p.grad * 4.0, want[k], scale(ref), f"{what} {k}", rtol)


def refused(name, method):
    rule = REFUSED.get(name, {})
    return rule.get("all") or rule.get(method)

def expect_error(word, fn, *args, **kwargs):
    with pytest.raises(WorkbenchError, match=word):
        quiet(fn, *args, **kwargs)

@pytest.mark.parametrize("name", NAMES)
def test_functional_api_is_exact_or_refused(name):
    model, loss_fn, rtol = model_of(name), PROBLEMS[name].loss_fn, PROBLEMS[name].rtol
    for x, y in batches(name):
        if refused(name, "all"):
            for method in ("microbatch", "vmap", "einsum"):
                expect_error(refused(name, "all"), wb.per_sample_gradients, model, loss_fn, x, y,
                             method=method)
            expect_error(refused(name, "all"), wb.clipped_grad_sum, model, loss_fn, x, y, 1.0)
            continue
        ref = one_at_a_time(model, loss_fn, x, y)
        size = scale(ref)
        for method in ("microbatch", "vmap", "einsum"):
            if refused(name, method):
                expect_error(refused(name, method), wb.per_sample_gradients, model, loss_fn, x,
                             y, method=method)
                continue
            got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method=method)
            assert set(got) == set(ref), (name, method)
            for k in ref:
                assert_close(got[k], ref[k], size, f"{name} {method} {k}", rtol)
        norms = norms_of(ref)
        C = float(norms.median())  # some samples clipped, some not
        want = clipped_sum(ref, C)
        assert_close(quiet(wb.per_sample_grad_norms, model, loss_fn, x, y, method="ghost"),
                     norms, size, f"{name} ghost norms", rtol)
        for method in ("ghost", "bookkeeping", "einsum"):
            got = quiet(wb.clipped_grad_sum, model, loss_fn, x, y, C, method=method)
            for k in want:
                assert_close(got[k], want[k], size, f"{name} clipped sum {method} {k}", rtol)

STEPS = (3, T, 4, T)  # Poisson-like batch sizes, n = T from the second step on

# T5's relative position bias (an Embedding on a (query, key) bucket matrix, permuted) is
# exact at n = T only because the optimizer re-probes every new call signature
# every optimizer mode on the subset (one model per rule family or refusal) even in CI: all 24
# models x 6 modes took about 30 minutes on 2 cores; the functional API above runs all of them
@pytest.mark.parametrize("name,mode", [(n, m) for n in SUBSET for m in (*MODES, "auto")])
def test_dp_optimizer_is_exact_every_step_or_refused(name, mode):
    word = refused(name, "all")  # Bloom: the optimizer's vmap mode is exact (not refused)
    if word:
        expect_error(word, optimizer_steps, name, mode)
    else:
        optimizer_steps(name, mode)

def optimizer_steps(name, mode):
    """Steps of Poisson-like sizes; each step's p.grad against the clipped reference."""
    model, loss_fn, rtol = model_of(name), PROBLEMS[name].loss_fn, PROBLEMS[name].rtol
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    opt = quiet(DPOptimizer, torch.optim.SGD(trainable, lr=0.0), model,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                method=mode, loss_reduction="sum")
    try:
        for step, n in enumerate(STEPS):
            x, y = PROBLEMS[name].batch(n, T=T, seed=10 + step)
            ref = one_at_a_time(model, loss_fn, x, y)
            step_matches(opt, model, loss_fn, x, y, ref, dict(model.named_parameters()),
                         f"{name} {mode} step {step}", rtol)
    finally:
        opt.detach()

TRANSFORMERS = [n for n in NAMES if PROBLEMS[n].kind != "image" and not refused(n, "all")]

@pytest.mark.parametrize("name", TRANSFORMERS)
def test_ghost_routes_take_no_vmap_route_on_transformers(name):
    model, loss_fn = model_of(name), PROBLEMS[name].loss_fn
    x, y = PROBLEMS[name].batch(3, T=T)
    routes = quiet(wb.ghost_routes, model, loss_fn, x, y)
    slow = set(routes[routes["route"].str.contains("vmap")]["type"])
    assert slow == VMAP_ROUTES.get(name, set()), routes[routes["route"].str.contains("vmap")]

def test_opt_flattened_mlp_takes_its_rules_not_the_whole_model_fallback():
    """OPT's decoder runs final_layer_norm, fc1 and fc2 on ``h.reshape(-1, d)``: the rows are
    proved sample-major (``per_sample/flat_rows.py``), so no layer takes the exact fallback."""
    model, loss_fn = model_of("opt"), PROBLEMS["opt"].loss_fn
    for n in (3, T):
        x, y = PROBLEMS["opt"].batch(n, T=T)
        routes = quiet(wb.ghost_routes, model, loss_fn, x, y)
        mlp = routes[routes["layer"].str.contains(r"layers\.\d+\.(fc1|fc2|final_layer_norm)$")]
        assert len(mlp) == 3, routes
        assert not routes["route"].str.contains("fallback|vmap").any(), routes

@pytest.mark.parametrize("n", [3, T])  # n = T: the bucket matrix (T, T) looks batch-first
def test_t5_relative_bias_takes_the_embedding_rule_not_the_fallback(n):
    """T5's relative position bias (an Embedding on a (T, T) bucket matrix, permuted, added to
    the scores: SDPA's attn_mask, a causal where in the decoder) is followed to its meetings
    (per_sample/broadcast.py): no call of the model takes the whole-model fallback."""
    model, loss_fn = model_of("t5"), PROBLEMS["t5"].loss_fn
    x, y = PROBLEMS["t5"].batch(n, T=T)
    routes = quiet(wb.ghost_routes, model, loss_fn, x, y)
    bias = routes[routes["layer"].str.endswith("relative_attention_bias")]
    assert len(bias) == 2 and set(bias["route"]) == {"segment sum"}, bias
    assert not routes["route"].str.contains("fallback").any(), routes

@pytest.mark.parametrize("n", [3, T])
def test_prompt_tuning_takes_the_embedding_rule_not_the_fallback(n):
    """PEFT's virtual tokens, computed once without the batch, ``repeat``-ed to it and
    concatenated before the token embeddings, are followed to that ``cat``
    (per_sample/concat.py): the prompt Embedding takes its rule, not the whole-model fallback."""
    model, loss_fn = model_of("prompt_tuning_gpt2"), PROBLEMS["prompt_tuning_gpt2"].loss_fn
    x, y = PROBLEMS["prompt_tuning_gpt2"].batch(n, T=T)
    routes = quiet(wb.ghost_routes, model, loss_fn, x, y)
    assert len(routes) == 1 and routes["type"].iloc[0] == "Embedding", routes
    assert not routes["route"].str.contains("fallback|vmap").any(), routes

def test_mixtral_router_logits_returned_and_unread_are_no_records():
    """``output_router_logits=True`` returns (n·T, E) router logits beside the logits; a loss
    on the logits alone was refused with "loss_fn must return one loss per sample, shape
    (1,); got shape (5,)" (the probe's record alone summed the unread output's T rows) until
    2026-11-30. The output the loss does not read adds nothing to the probe's sum."""
    name = "mixtral"
    hf, rtol = model_of(name).hf, PROBLEMS[name].rtol
    params = dict(hf.named_parameters())

    def run(ids):
        return hf(input_ids=ids, output_router_logits=True)

    def loss_fn(out, y):
        return PROBLEMS[name].loss_fn(out.logits, y)

    opt = quiet(DPOptimizer, torch.optim.SGD(params.values(), lr=0.0), hf,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                loss_reduction="sum")
    try:
        for step, n in enumerate((3, T)):
            x, y = PROBLEMS[name].batch(n, T=T, seed=20 + step)
            rows = [quiet(torch.autograd.grad, loss_fn(run(x[i:i + 1]), y[i:i + 1]).sum(),
                          list(params.values()), allow_unused=True) for i in range(n)]
            ref = {k: torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows])
                   for j, (k, p) in enumerate(params.items())}
            step_matches(opt, run, loss_fn, x, y, ref, params, f"{name} step {step}", rtol)
    finally:
        opt.detach()

@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_mixtral_aux_loss_read_by_the_loss_is_refused(method):
    """The router's load-balancing loss (``output_router_logits=True``: 0-dim ``aux_loss``,
    over every token of the batch, its router in float32) added to each record's loss: ghost
    clipping returned a clipped sum 59% off on ``mlp.gate.weight`` under float32's tolerance
    until 2026-12-02. Refused in every batched method as a 0-dim output, and by the optimizer
    as a loss the model computed (``dpsgd/model_loss.py``;
    ``tests/per_sample/test_batch_wide_outputs.py`` holds the family)."""
    name = "mixtral"
    hf = model_of(name).hf

    class WithAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            out = self.hf(input_ids=ids, output_router_logits=True)
            return out.logits, out.aux_loss

    def run(ids):
        out = hf(input_ids=ids, output_router_logits=True)
        return out.logits, out.aux_loss

    def loss_fn(out, y):
        return PROBLEMS[name].loss_fn(out[0], y) + 0.02 * out[1]

    x, y = PROBLEMS[name].batch(3, T=T, seed=0)
    expect_error("0-dim output of the model", wb.clipped_grad_sum, WithAux(), loss_fn, x, y,
                 1.0, method=method)
    if method != "einsum":
        return
    params = dict(hf.named_parameters())
    opt = quiet(DPOptimizer, torch.optim.SGD(params.values(), lr=0.0), hf,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                loss_reduction="sum")
    try:
        with pytest.raises(WorkbenchError, match="aux_loss"):  # model_loss.py's own words
            opt.zero_grad()
            loss_fn(run(x), y).sum().backward()
            quiet(opt.step)
    finally:
        opt.detach()
