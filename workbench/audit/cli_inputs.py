"""The headless audit's user inputs, checked before anything runs.

``--model``, ``--data``, ``--provider`` and ``--step`` name ``module:callable``; ``--out`` a
folder. A model returning a Hugging Face ``ModelOutput`` (or a dict) with ``logits`` is
audited as ``inputs -> logits`` (``Logits``). Every problem raises :class:`InputError` with one
line that names the option, the value and what is wrong; ``cli.main`` prints it without a
traceback and exits 2. Code under audit that loads but then fails *during* the audit is a
finding of the audit instead (exit 1).
"""

import importlib
from pathlib import Path

import torch
from torch import nn

from workbench.outputs import OutputPathError, check_output_dir


class InputError(Exception):
    """A usage or input error of ``python -m workbench audit`` (exit code 2)."""


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def load_callable(spec: str, option: str):
    """'package.module:function' -> the callable, or an InputError naming ``option``."""
    module_name, _, attr = (spec or "").partition(":")
    if not module_name or not attr:
        raise InputError(f"{option} must look like module:callable (e.g. mymodels:make_net); "
                         f"got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001  (any import failure is the user's input)
        raise InputError(f"{option} {spec!r}: module {module_name!r} could not be imported "
                         f"({type(err).__name__}: {err})") from None
    if not hasattr(module, attr):
        raise InputError(f"{option} {spec!r}: module {module_name!r} has no attribute "
                         f"{attr!r}") from None
    found = getattr(module, attr)
    if not callable(found):
        raise InputError(f"{option} {spec!r} is {_kind(found)}, not a callable")
    return found


def _call(fn, spec, option, *args):
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001
        raise InputError(f"{option} {spec!r} raised {type(err).__name__}: {err}") from None


def user_case(model_spec: str, data_spec: str, loss_fn, loss_name: str):
    """(name, model, inputs, targets) from --model and --data, checked with one forward pass
    and the per-sample loss: a module, a batch (inputs, targets) with matching dim 0, outputs
    of the same batch size, and a loss of shape (n,)."""
    if not data_spec:
        raise InputError("--model needs --data module:callable returning (inputs, targets)")
    model = _call(load_callable(model_spec, "--model"), model_spec, "--model")
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {model_spec!r} returned {_kind(model)}, not a "
                         f"torch.nn.Module")
    batch = _call(load_callable(data_spec, "--data"), data_spec, "--data")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise InputError(f"--data {data_spec!r} returned {_kind(batch)}; it must return a "
                         f"pair (inputs, targets) with the batch on dim 0")
    inputs, targets = batch
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise InputError(f"--data {data_spec!r} returned ({_kind(inputs)}, {_kind(targets)}); "
                         f"both inputs and targets must be Tensors")
    n = len(inputs)
    if inputs.dim() == 0 or len(targets) != n or n < 2:
        raise InputError(f"--data {data_spec!r}: inputs {tuple(inputs.shape)} and targets "
                         f"{tuple(targets.shape)} need the same batch size n >= 2 on dim 0")
    with torch.no_grad():
        out = _forward(model, model_spec, inputs, data_spec)
        if has_logits(model(inputs)):
            model = Logits(model)
        try:
            loss = loss_fn(out, targets)
        except Exception as err:  # noqa: BLE001
            raise InputError(f"--loss {loss_name} cannot compare --model's outputs "
                             f"{tuple(out.shape)} with --data's targets {tuple(targets.shape)} "
                             f"({type(err).__name__}: {err})") from None
    if tuple(loss.shape) != (n,):
        raise InputError(f"--loss {loss_name} on outputs {tuple(out.shape)} and targets "
                         f"{tuple(targets.shape)} gives shape {tuple(loss.shape)}, not ({n},): "
                         f"one loss per sample is needed")
    return model_spec, model, inputs, targets


class Logits(nn.Module):
    """A model whose forward returns a Hugging Face ``ModelOutput`` (or a dict) with
    ``logits``, as ``inputs -> logits``: the same parameters, under ``model.``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        return self.model(inputs)["logits"]


def has_logits(out) -> bool:
    return isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor)


def _forward(model, model_spec, inputs, data_spec):
    try:
        out = model(inputs)
    except Exception as err:  # noqa: BLE001
        raise InputError(f"--model {model_spec!r} cannot take --data {data_spec!r}'s inputs of "
                         f"shape {tuple(inputs.shape)} ({type(err).__name__}: {err})") from None
    if has_logits(out):  # transformers' ModelOutput is a dict: audit its logits
        out = out["logits"]
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or len(out) != len(inputs):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else _kind(out)
        raise InputError(f"--model {model_spec!r} returned outputs {shape} for inputs "
                         f"{tuple(inputs.shape)}; dim 0 must be the batch ({len(inputs)})")
    return out


def user_step(spec: str, C: float, sigma: float, B: float, dim: int):
    """The --step factory, checked: factory(C, σ, B, generator) must return a step_fn and
    step_fn(G (2, dim)) a Tensor of shape (dim,)."""
    factory = load_callable(spec, "--step")
    step = _call(factory, spec, "--step", C, sigma, B, torch.Generator().manual_seed(0))
    if not callable(step):
        raise InputError(f"--step {spec!r} returned {_kind(step)}; the factory "
                         f"(max_grad_norm, noise_multiplier, batch_size, generator) must return "
                         f"step_fn(G) -> Tensor(d)")
    y = _call(step, spec, "--step's step_fn", torch.ones(2, dim, dtype=torch.float64))
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (dim,):
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else _kind(y)
        raise InputError(f"--step {spec!r}: step_fn(G) for G of shape (2, {dim}) returned "
                         f"{got}; it must return a Tensor of shape ({dim},)")
    return factory


def user_provider(spec: str, case, loss_fn):
    """The --provider callable, checked on the first audited ``case`` (name, model, inputs,
    targets; None: not called) before the audit runs: ``provider(model, loss_fn, inputs,
    targets)`` must return {parameter name: Tensor(n, *shape)}. (A wrong signature or return
    type surfaced only in the report, after the whole suite ran, as "'function' object is not
    iterable".) Wrong values are the audit's finding, not an input error."""
    provider = load_callable(spec, "--provider")
    if case is None:
        return provider
    _, model, x, y = case
    got = _call(provider, spec, "--provider", model, loss_fn, x, y)
    names = {k: p for k, p in model.named_parameters() if p.requires_grad}
    form = ("provider(model, loss_fn, inputs, targets) must return {parameter name: "
            "Tensor(n, *parameter.shape)}, as wb.per_sample_gradients does")
    if not isinstance(got, dict):
        raise InputError(f"--provider {spec!r} returned {_kind(got)}; {form}")
    for k, g in got.items():
        if k not in names:
            raise InputError(f"--provider {spec!r} returned a key {k!r} that is no trainable "
                             f"parameter of the model ({', '.join(list(names)[:4])}, ...); "
                             f"{form}")
        want = (len(x), *names[k].shape)
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != want:
            raise InputError(f"--provider {spec!r} returned {_kind(g)} for {k!r} on "
                             f"{len(x)} records, not shape {want}; {form}")
    return provider


def check_out(out: Path) -> Path:
    """Create --out and prove it writable (``workbench.outputs``), before the audit spends
    minutes."""
    try:
        return check_output_dir(out, "--out")
    except OutputPathError as err:
        raise InputError(str(err)) from None


__all__ = [
    "InputError", "Logits", "check_out", "has_logits", "load_callable", "user_case",
    "user_provider", "user_step",
]
