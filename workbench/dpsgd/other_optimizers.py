"""Every update of a private model's parameters is a DP step: clipped, noised and accounted.

Between ``loss.backward()`` and the DP step, each parameter's ``.grad`` holds the ordinary
(unclipped, noiseless) gradient of the batch: the recording reads the per-sample gradients,
and ``DPOptimizer.step`` replaces ``.grad`` by the released sum. Two ways around it:

- **the wrapped optimizer stepped directly**: the optimizer passed to ``make_private`` (or to
  ``DPOptimizer``) is stepped by ``DPOptimizer.step`` after the noise is added and the step
  accounted; the loop that keeps calling it by its old name (``optimizer.step()`` after
  ``model, dp_optimizer, loader = engine.make_private(optimizer=optimizer, ...)``, a bound
  ``step = optimizer.step`` taken before, ``type(optimizer).step(optimizer)``, a wrapper of
  it built before) moved the weights by the batch's exact gradient with nothing accounted,
  warned only as a skipped batch, until 2026-11-30. It is refused at any time but inside
  the DP optimizer's own step (``dp._stepping``), after the DP step too (a second update);
- **a second optimizer** over the same parameters (a leftover ``torch.optim.SGD(model.
  parameters())`` from the non-private loop, an optimizer for a parameter subset built before
  ``make_private``) that steps on that ``.grad``: refused when a recorded parameter's
  ``.grad`` is not the one the last DP step released (a new tensor, or the released one
  accumulated into in place by a backward pass without ``zero_grad()``: its version), and
  when it is handed a closure (the closure recomputes the ordinary gradient inside the step,
  after this check). Stepping it *after* the DP step, on the released gradient, is
  post-processing and fine.

``guard(dp)`` registers a global optimizer step pre-hook (``torch.optim.optimizer.register_
optimizer_step_pre_hook``, held weakly, removed with the optimizer or at ``detach``): every
torch optimizer's ``step`` runs it, whatever spelling called it, and it raises ``LoopError``
before anything moves. An optimizer that wraps the DP optimizer (Lookahead's
``base_optimizer``) is not another one. Manual updates (``p.data -= lr * p.grad``) are no
optimizer step and are not seen here.
"""

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from workbench.errors import LoopError


def _wraps(optimizer, dp) -> bool:
    return any(v is dp for v in vars(optimizer).values())


def released(dp, p) -> bool:
    """Whether ``p.grad`` is the gradient the last DP step released, unchanged since."""
    g = p.grad
    return dp._released.get(id(p)) is g and (
        g is None or dp.__dict__.get("_released_versions", {}).get(id(p)) == g._version)


def check(dp, optimizer, closure=None) -> None:
    """LoopError when ``optimizer`` would update ``dp``'s parameters other than as the DP step
    (module docstring): the wrapped optimizer outside ``DPOptimizer.step``, or another one on
    a non-private ``.grad`` or with a closure."""
    if optimizer is dp or "_detached" in dp.__dict__ or _wraps(optimizer, dp):
        return
    name = type(optimizer).__name__
    if optimizer is dp.__dict__.get("original_optimizer"):
        if dp.__dict__.get("_stepping"):
            return  # DPOptimizer.step itself, on the released gradient
        raise LoopError(
            f"{name}.step() called on the optimizer passed to make_private (the one the "
            f"DPOptimizer wraps): its update is not a DP step (the .grad it reads is the "
            f"batch's ordinary, unclipped and noiseless gradient, or the DP step's already "
            f"applied), and the accountant charges nothing for it. Call step() and "
            f"zero_grad() on the DP optimizer make_private returned (model, optimizer, "
            f"loader = engine.make_private(...): rebind the name), which steps this "
            f"{name} itself after clipping, noising and accounting")
    names = {id(p): k for k, p in dp.recorder.params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                continue
            if closure is not None:
                raise LoopError(
                    f"{name}.step(closure) over the private model's parameter "
                    f"{names[id(p)]!r}: the closure computes the batch's ordinary (unclipped, "
                    f"noiseless) gradient inside the step, and the update would release it "
                    f"with nothing accounted. Pass the closure to the DP optimizer "
                    f"make_private returned (dp_optimizer.step(closure)), or step this one "
                    f"without a closure after the DP step, on the released gradient")
            if p.grad is not None and not released(dp, p):
                raise LoopError(
                    f"{name}.step() over the private model's parameter "
                    f"{names[id(p)]!r}, whose .grad is its ordinary (unclipped, noiseless) "
                    f"gradient: that update would release the batch's exact gradient, with "
                    f"nothing accounted. Step only the DP optimizer make_private returned "
                    f"(pass every parameter group to the optimizer given to make_private), or "
                    f"step this one after the DP step, on the released gradient")


def guard(dp):
    """The step pre-hook for ``dp`` (module docstring); returns its handle."""
    ref = weakref.ref(dp)

    def hook(optimizer, args, kwargs):
        owner = ref()
        if owner is not None:
            closure = args[1] if len(args) > 1 else (kwargs or {}).get("closure")  # args[0]: self
            check(owner, optimizer, closure)

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(dp, handle.remove)
    return handle


__all__ = ["check", "guard", "released"]
