"""Seeing the loss in the user's own loop: the criterion calls after the model's forward pass.

``DPOptimizer`` is handed no loss: the loop computes ``loss = criterion(model(x), y)`` and
calls ``loss.backward()``. Between the model's forward pass and the backward pass, while the
*window* is open, a global module hook (``torch.nn.modules.module.register_module_forward_
hook``, on only for that window) sees every outermost module call that is a loss: a
``torch.nn`` loss (``_Loss``), the ``criterion=`` given to ``make_private``, or any module
returning a scalar that requires grad. For each such call (``per_sample.loss``):

- its reduction must be the optimizer's ``loss_reduction`` (else ``ValueError``);
- the per-record factors f (Eq. 2 of ``loss.py``) that make record i's recorded gradient the
  gradient of its own loss (class weights, ``ignore_index``) are computed from the targets;
- the first call with a new signature (type, reduction, shapes with n symbolic) is probed
  at the next ``step()``, after the recorded activations are freed (``probe``): a loss
  coupling records raises ``LossCouplingError`` before anything is released.

A loss written as a plain function (``F.cross_entropy``) is not a module call and is not
seen: its records are then taken as ``loss_reduction`` says (f = n or 1), as before. Pass
an ``nn`` loss module (or wrap the function in one and pass it as ``criterion=``) to have it
checked.

Notation: n batch size, f (n,) per-record factors.
"""

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.nn.modules.loss import _Loss

from workbench.errors import LossCouplingError
from workbench.per_sample.loss import check_separable, record_factors, reduction_of
from workbench.per_sample.selfcheck import TOLERANCE, symbolic


class LossWatch:
    """The loss calls of each backward pass (``generation``): (generation, f, name). One
    window is open at a time, process-wide: the last model's forward pass owns the loss."""

    _open: "LossWatch | None" = None

    def __init__(self, loss_reduction: str, criterion=None):
        self.loss_reduction, self.criterion = loss_reduction, criterion
        self.calls: list[tuple[int, torch.Tensor, str]] = []
        self.checked: set = set()  # loss signatures already probed
        self.pending: list = []  # (key, criterion, z, rest, n, reduction): probed at step
        self.check = True  # the optimizer's verify policy: False skips the probe
        self.n, self.generation, self._depth, self._busy = 0, 0, 0, False
        self._handles: list = []

    def open(self, n: int, generation: int) -> None:
        """At the end of the model's forward pass (n records, before backward ``generation``)."""
        self.n, self.generation, self._depth = n, generation, 0
        if LossWatch._open is not None and LossWatch._open is not self:
            LossWatch._open.close()
        LossWatch._open = self
        if not self._handles:
            self._handles = [module_hooks.register_module_forward_pre_hook(self._enter),
                             module_hooks.register_module_forward_hook(self._exit)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if LossWatch._open is self:
            LossWatch._open = None

    def clear(self) -> None:
        self.calls = []
        self.pending = []

    def _enter(self, module, args):
        self._depth += 1

    def _exit(self, module, args, output):
        self._depth = max(self._depth - 1, 0)
        if self._depth or self._busy or not self._is_loss(module, output):
            return
        z = args[0] if args else None
        if not isinstance(z, torch.Tensor) or not z.requires_grad or not z.dim():
            return
        self._busy = True  # the probe calls the criterion again: not a loss call of the loop
        try:
            self.calls.append((self.generation, self._factors(module, z, args[1:]),
                               type(module).__name__))
        finally:
            self._busy = False

    def _is_loss(self, module, output) -> bool:
        if isinstance(module, _Loss) or module is self.criterion:
            return True
        return (isinstance(output, torch.Tensor) and output.dim() == 0 and output.requires_grad
                and not isinstance(module, nn.Sequential))

    def _factors(self, criterion, z, rest) -> torch.Tensor:
        reduction = reduction_of(criterion, self.loss_reduction)
        n = self.n
        shapes = tuple(symbolic(a.shape, n) for a in (z, *rest) if isinstance(a, torch.Tensor))
        key = (type(criterion), reduction, shapes)
        if self.check and key not in self.checked:
            self.pending.append((key, criterion, z.detach(), tuple(rest), n, reduction))
        return record_factors(criterion, z.detach(), rest[0] if rest else None, n, reduction)

    def probe(self) -> None:
        """The separability probe (``loss.check_separable``) of each new loss signature."""
        pending, self.pending = self.pending, []
        for key, criterion, z, rest, n, reduction in pending:
            if key not in self.checked:
                check_separable(criterion, z, rest, n, reduction, TOLERANCE.get(z.dtype, 1e-3))
                self.checked.add(key)

    def factors(self, generation: int, n: int) -> torch.Tensor | None:
        """f (n,) of one backward pass: the loss calls' own (they must agree), or None when
        no loss call was seen."""
        mine = [(f, name) for g, f, name in self.calls if g == generation and f.shape[0] == n]
        if not mine:
            return None
        f0, name0 = mine[0]
        for f, name in mine[1:]:
            if not torch.allclose(f.to(f0.dtype), f0, rtol=1e-5):
                raise LossCouplingError(
                    f"two losses of one backward pass ({name0} and {name}) normalise records "
                    f"differently (class weights or ignored positions), so the records' "
                    f"gradients cannot be rescaled to their own losses; use reduction='sum' "
                    f"(and loss_reduction='sum') or one loss")
        return f0
