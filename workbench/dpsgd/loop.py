"""Guards on how a training loop uses a ``DPOptimizer``: what the loop may change, and who.

The DP-SGD guarantee (Abadi et al. 2016, arXiv 1607.00133, Algorithm 1) holds for the update

    p.grad = (Σ_i c_i g_i + N(0, σ² C² I)) / B,        one accountant step per update,

only if σ, C and B are the numbers the accountant is told, every update is accounted, and
each update's Σ_i c_i g_i comes from one logical batch recorded by one thread. Three guards
here keep those true whatever the loop does:

- ``Checked``: a public setting assigned after construction (``optimizer.noise_multiplier =
  nan``, a scheduler's σ) is validated on assignment by the same check the constructor uses
  (``workbench.checks``), so a bad value fails there with our message, not inside torch or the
  accountant after the weights have moved.
- ``ThreadGuard``: the recording hooks keep one batch at a time. Two threads running forward,
  backward or step on one private model interleave their records (wrong sums, or internal
  errors); the guard lets one thread own the model from its forward pass to its ``step()``
  and raises ``ConcurrentUseError`` in any other thread that enters meanwhile.
- ``check_alive``: a ``DPOptimizer`` detached by a later ``make_private`` on (part of) its
  model records nothing any more; using it again raises, naming the fix.

Notation: σ noise multiplier, C max_grad_norm, B = qN expected batch size.
"""

import threading

from workbench.checks import check_max_grad_norm
from workbench.errors import LoopError, WorkbenchError


class ConcurrentUseError(WorkbenchError, RuntimeError):
    """Two threads used one private model (or one DPOptimizer) at the same time."""


class Checked:
    """A data descriptor whose assignments go through ``check(owner, value)``."""

    def __init__(self, check, doc: str = ""):
        self.check, self.__doc__ = check, doc

    def __set_name__(self, owner, name):
        self.name, self.slot = name, f"_checked_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = self.check(obj, value)


class ClipNorms(list):
    """``max_grad_norm`` per parameter group: an edit in place (``opt.max_grad_norm[0] =
    -1.0``) is checked as an assignment is (a negative C clipped with factors -11.7 and
    pushed the weights up the gradient, a NaN reached torch's normal(), silently or
    obscurely, until 2026-11-30); its length stays one C per group. ``changed(self)``: the
    optimizer's check that no logical batch is half accumulated."""

    changed = staticmethod(lambda value: None)

    def __setitem__(self, key, value):
        if isinstance(key, slice):
            raise TypeError("the per-group max_grad_norm takes one C per group: assign a new "
                            "list, optimizer.max_grad_norm = [...], to change several")
        new = ClipNorms(self)
        list.__setitem__(new, key, check_max_grad_norm(value))
        self.changed(new)
        list.__setitem__(self, key, new[key])

    def _fixed(self, *args, **kwargs):
        raise TypeError("the per-group max_grad_norm holds one C per parameter group: its "
                        "length cannot change; assign optimizer.max_grad_norm = [...] instead")

    append = extend = insert = pop = remove = clear = sort = reverse = _fixed
    __delitem__ = __iadd__ = __imul__ = _fixed

    def __reduce__(self):  # copied, pickled and saved as the plain list (checkpoints)
        return list, (list(self),)


def check_verify(value):
    if value not in (True, "always", False) or isinstance(value, int) and value not in (0, 1):
        raise ValueError(f"verify must be True (verify every new call signature), 'always' "
                         f"(every step) or False (none: benchmarks only); got {value!r} "
                         f"(optimizer.verify_next_step() asks for one more check)")
    return value


def check_loss_reduction(value):
    if value not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' (criterion averages over the batch) "
                         f"or 'sum'; got {value!r}")
    return value


def check_generator(value, name="generator"):
    """None, a torch.Generator, or secure mode's generator of generators."""
    import torch

    if value is None or isinstance(value, torch.Generator) or hasattr(value, "next"):
        return value
    raise TypeError(f"{name} must be a torch.Generator (seeded noise), or None (torch's global "
                    f"generator); got {type(value).__name__}")


def check_callback(value, name="on_step"):
    if value is None or callable(value):
        return value
    raise TypeError(f"{name} must be callable (called as {name}(noise_multiplier) after each "
                    f"logical step, before the weights move) or None; got "
                    f"{type(value).__name__}")


class ThreadGuard:
    """One thread at a time owns a private model, from its forward pass to ``step()``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.owner = None  # the threading.Thread that is between a forward pass and a step

    def enter(self, what: str) -> None:
        """Called on every forward pass, ``zero_grad`` and ``step``: claim or check."""
        me = threading.current_thread()
        with self._lock:
            owner = self.owner
            if owner is None or owner is me or not owner.is_alive():
                self.owner = me
                return
        raise ConcurrentUseError(
            f"{what} in thread {me.name!r} while thread {owner.name!r} is between a forward "
            f"pass and its optimizer.step() on the same private model: the recording hooks "
            f"keep one batch at a time, so the two threads' records would mix (wrong clipped "
            f"sums). Train one model from one thread at a time (join the other first), or "
            f"give each thread its own model copy and make_private")

    def release(self) -> None:
        """After a step (or a zero_grad in the owning thread): the model is free again."""
        with self._lock:
            if self.owner is threading.current_thread():
                self.owner = None


def check_alive(optimizer, what: str) -> None:
    """Refuse a DPOptimizer that a later make_private detached from its model."""
    reason = optimizer.__dict__.get("_detached")
    if reason:
        raise LoopError(f"optimizer.{what}() on a DPOptimizer that no longer records its "
                           f"model: {reason}. Use the optimizer (and loader) returned by the "
                           f"latest make_private on this model")


def drop_gradients(params) -> list:
    """Hooks that drop each of ``params``' gradients as soon as backward accumulates it: a
    trainable parameter outside the optimizer never holds a non-private ``.grad``, not even
    between ``backward()`` and ``step()``. Returns the handles (removed by ``detach``)."""
    from workbench.per_sample.hooks import OwnHook  # a copy of the model gets inert ones

    def drop(p):
        p.grad = None

    return [p.register_post_accumulate_grad_hook(OwnHook(drop)) for p in params]


def check_inputs_private(calls) -> None:
    """Refuse a model input computed from trainable tensors outside the model: backward sends
    them each record's unclipped, unnoised gradient (another model, an embedding or a
    learned prompt in front of the private model)."""
    import torch
    from torch.utils._pytree import tree_flatten

    for call in calls:
        args = tree_flatten((call.args, call.kwargs))[0]
        if any(isinstance(a, torch.Tensor) and a.grad_fn is not None for a in args):
            raise LoopError(
                "the private model's input was computed from trainable tensors outside it "
                "(e.g. an encoder, embedding or learned prompt applied before model(x)): "
                "backward() leaves their .grad unclipped and unnoised, a non-private gradient "
                "of every record. Put those layers inside the module given to make_private "
                "(one nn.Module holding both), or freeze them (requires_grad_(False)) or "
                "detach the input (model(x.detach()))")


__all__ = [
    "Checked", "ClipNorms", "ConcurrentUseError", "ThreadGuard", "check_alive", "check_callback",
    "check_generator", "check_inputs_private", "check_loss_reduction", "check_verify",
    "drop_gradients",
]
