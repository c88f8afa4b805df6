"""Another optimizer over the private model's parameters: it must not step on their
non-private ``.grad``.

Between ``loss.backward()`` and the DP step, each parameter's ``.grad`` holds the ordinary
(unclipped, noiseless) gradient of the batch: the recording reads the per-sample gradients,
and ``DPOptimizer.step`` replaces ``.grad`` by the released sum. A second optimizer over the
same parameters (a leftover ``torch.optim.SGD(model.parameters())`` from the non-private
loop, an optimizer for a parameter subset built before ``make_private``) that steps on that
``.grad`` moves the weights by the exact gradient: a release without noise, and nothing
accounted. Stepping *after* the DP step uses the released gradient (post-processing) and is
fine.

``guard(dp)`` registers a global optimizer step pre-hook (``torch.optim.optimizer.register_
optimizer_step_pre_hook``, held weakly, removed with the optimizer or at ``detach``): a step
of any other optimizer that holds a recorded parameter whose ``.grad`` is not the one the
last DP step released raises ``RuntimeError`` before it moves anything. An optimizer that
wraps the DP optimizer (Lookahead's ``base_optimizer``) is not another one.
"""

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from workbench.errors import LoopError


def _wraps(optimizer, dp) -> bool:
    return any(v is dp or v is dp.original_optimizer for v in vars(optimizer).values())


def check(dp, optimizer) -> None:
    """RuntimeError when ``optimizer`` (not ``dp``) would step on a non-private ``.grad``."""
    if optimizer is dp or optimizer is dp.__dict__.get("original_optimizer") \
            or "_detached" in dp.__dict__ or _wraps(optimizer, dp):
        return
    names = {id(p): name for name, p in dp.recorder.params.items()}
    released = dp._released
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in names and p.grad is not None and released.get(id(p)) is not p.grad:
                raise LoopError(
                    f"{type(optimizer).__name__}.step() over the private model's parameter "
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
            check(owner, optimizer)

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(dp, handle.remove)
    return handle


__all__ = ["check", "guard"]
