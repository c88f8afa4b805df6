"""Shared test helpers: the agreement check every fast method must pass against micro-batching."""

import torch

import workbench as wb
from workbench.audit.gradients import model_floor, relative_error  # (one home: the audit's)

# float64: the methods differ only by summation order, so ~1e2 ulp (1e-14) is typical; the
# issue's bar is 1e-9. float32: eps = 1.2e-7, times sums over up to ~1e3 terms -> 1e-4.
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}




def assert_agree(model, loss_fn, inputs, targets, methods=("vmap", "einsum"), **kwargs):
    """Every method's per-sample gradients equal micro-batching's within RTOL[dtype]."""
    ref = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="microbatch")
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(ref) == expected
    n = (inputs[0] if isinstance(inputs, tuple) else inputs).shape[0]
    floor = model_floor(ref)  # a gradient that is 0 by symmetry (a bias before a softmax, a
    # shift of every logit) is rounding noise, compared at the model's scale: its relative
    # error depended on the CPU's summation order (0.5 on one machine, 0 on another)
    for method in methods:
        got = wb.per_sample_gradients(model, loss_fn, inputs, targets, method=method, **kwargs)
        assert set(got) == expected, method
        for name, g in got.items():
            p = dict(model.named_parameters())[name]
            assert g.shape == (n, *p.shape), (method, name, g.shape)
            assert g.dtype == p.dtype, (method, name)
            err = relative_error(g, ref[name], floor)
            assert err <= RTOL[p.dtype], f"{method} {name}: relative error {err:.2e}"
    return ref


def ce_per_sample(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


def one_at_a_time_grads(model, loss_fn, x, y) -> dict:
    """{name: (n, *p.shape)}: each record's gradient from a forward and backward pass of its
    own (plain autograd, none of the workbench's code): the independent twin."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                list(params.values())) for i in range(x.shape[0])]
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def classification_batch(n, d, k, seed):
    """(x (n, d) float64, labels (n,) in [0, k))."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64),
            torch.randint(0, k, (n,), generator=g))


def mse_per_sample(outputs, targets):
    """A regression loss with one value per sample, reducing every non-batch dim."""
    return ((outputs - targets) ** 2).flatten(1).sum(dim=1)


def random_batch(shape, out_shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=dtype),
            torch.randn(out_shape, generator=g, dtype=dtype))


def assert_clipping_agrees(model, loss_fn, inputs, targets, max_grad_norm=None):
    """Norms and clipped sums of every method equal micro-batching's within RTOL[dtype].

    ``max_grad_norm`` defaults to the median reference norm, so some samples are clipped
    and some are not.
    """
    from workbench.clipping import CLIP_METHODS, NORM_METHODS

    ref_norms = wb.per_sample_grad_norms(model, loss_fn, inputs, targets, method="microbatch")
    dtype = ref_norms.dtype
    for method in NORM_METHODS[1:]:
        norms = wb.per_sample_grad_norms(model, loss_fn, inputs, targets, method=method)
        err = relative_error(norms, ref_norms)
        assert err <= RTOL[dtype], f"norms by {method}: relative error {err:.2e}"
    C = float(ref_norms.median()) if max_grad_norm is None else max_grad_norm
    ref = wb.clipped_grad_sum(model, loss_fn, inputs, targets, C, method="microbatch")
    floor = model_floor(ref)  # a sum that is 0 by symmetry: rounding noise (assert_agree)
    for method in CLIP_METHODS[1:]:
        got = wb.clipped_grad_sum(model, loss_fn, inputs, targets, C, method=method)
        assert set(got) == set(ref), method
        for name, g in got.items():
            err = relative_error(g, ref[name], floor)
            assert err <= RTOL[dtype], f"clipped sum by {method}, {name}: rel. error {err:.2e}"
    return ref_norms, ref


def assert_clipped_sums_agree(model, loss_fn, inputs, targets, max_grad_norm, **kwargs):
    """ghost, book-keeping and einsum clipped sums equal micro-batching's to 1e-9 (float64),
    with the keyword options given (``check=False``: a fast path must be right without it)."""
    want = wb.clipped_grad_sum(model, loss_fn, inputs, targets, max_grad_norm,
                               method="microbatch")
    for method in ("ghost", "bookkeeping", "einsum"):
        got = wb.clipped_grad_sum(model, loss_fn, inputs, targets, max_grad_norm,
                                  method=method, **kwargs)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


def exact_routes(model, inputs, targets, loss_fn=mse_per_sample):
    """A rule's model: every method and the clipped sums against micro-batching (float64),
    then ``ghost_routes``' table for the caller's route assertions."""
    assert_agree(model, loss_fn, inputs, targets, check="always")
    assert_clipping_agrees(model, loss_fn, inputs, targets)
    return wb.ghost_routes(model, loss_fn, inputs, targets)


def import_rule_package(root, package: str, files: dict[str, str]) -> None:
    """Write a rule package ``root/package`` holding ``files`` {name: source} and an
    ``__init__`` that imports every file in it (as ``workbench.rules`` does), then import the
    package alone: it must find its rule files. ``root`` must be on ``sys.path``."""
    import importlib
    import textwrap

    folder = root / package
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "from workbench.plugins import import_submodules\n\n"
        "import_submodules(__name__, __path__)\n")
    for name, source in files.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    importlib.import_module(package)


def assert_optimizer_matches_microbatch(model, loss_fn, batches, max_grad_norm=0.5,
                                        method=None, verify=True):
    """DPOptimizer (no noise, lr 0) steps on ``batches`` [(x, y)]: each step's p.grad equals
    micro-batching's clipped sum, float64 to 1e-9; ``verify=False``: without the optimizer's
    self-check (a fast path must be right without it)."""
    from workbench.dpsgd import DPOptimizer

    kwargs = {} if method is None else {"method": method}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(trainable, lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=max_grad_norm, expected_batch_size=1.0,
                      loss_reduction="sum", **kwargs)
    if not verify:
        opt.verify = False
    try:
        for x, y in batches:
            want = wb.clipped_grad_sum(model, loss_fn, x, y, max_grad_norm, method="microbatch")
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            opt.step()
            for k, p in model.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()
