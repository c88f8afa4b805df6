"""The loss window's lifetime: it never outlives its optimizer step or its model.

The loss window (``loss_watch.LossWatch``) and the batch follower (``BeforeForward``) act
process-wide: global module hooks and ``TorchFunctionMode``\\ s on torch's stack. A window
that outlived its pass would take another model's (or another test's) loss for its own and
refuse it with this model's ``loss_reduction``. **The invariant**, one mechanism per way a
window can be left behind:

- *its step*: ``DPOptimizer.step()`` closes the window on every exit, a refused step too;
- *a refusal*: an error the window raises (a reduction mismatch, a coupled loss) closes it;
- *an abandoned loop* (an error in the user's code between the forward and the step): a
  loss belongs to the window only if it is computed from the model's outputs (``reaches``:
  the loss's autograd graph meets theirs), so another computation's loss passes untouched;
- *the user's own modes*: ours are pushed at the bottom of torch's stack (``push_bottom``),
  so a ``with TorchFunctionMode():`` block of the user's that ends while ours is on pops
  its own mode, not ours;
- *its model*: the global hooks and the modes hold the watch weakly (``Weak``,
  ``weak_attribute``); when the engine is garbage-collected its hooks are removed
  (``remove``, a ``weakref.finalize``) and its modes pass calls through until the next
  window takes them off the stack (``sweep``).
"""

import weakref

import torch

#: graph nodes walked from a loss to the model's outputs before taking it as connected
LIMIT = 4096


class Weak:
    """A global hook calling ``watch.<name>`` while the watch lives, nothing after; run with
    torch-function dispatch off (``uses.quiet``): its own tensor calls are not the loop's."""

    observer = True  # returns what the watch's hook returns: None (hooks._warn_global_hooks)

    def __init__(self, watch, name: str):
        self.ref, self.name = weakref.ref(watch), name

    def __call__(self, *args):
        watch = self.ref()
        if watch is None:
            return None
        with torch._C.DisableTorchFunction():
            return getattr(watch, self.name)(*args)


def weak_attribute(name: str) -> property:
    """An attribute held by a weak reference (None once its object is gone)."""
    slot = f"_{name}_ref"

    def get(self):
        ref = self.__dict__.get(slot)
        return None if ref is None else ref()

    def set_(self, value):
        self.__dict__[slot] = None if value is None else weakref.ref(value)

    return property(get, set_)


def remove(handles: list) -> None:
    """``weakref.finalize`` of a watch: its global hooks go (torch copies the hook table
    before calling the hooks, so this is safe inside a module call)."""
    for handle in handles:
        handle.remove()
    handles.clear()


def stale(mode) -> bool:
    """A loss window's mode whose watch (or follower's statistics) is gone: the mode says so
    (``is_stale``, defined by ``loss_watch.LossFunctions`` and ``BeforeForward``)."""
    check = getattr(mode, "is_stale", None)
    return bool(check is not None and check())


def sweep() -> None:
    """Take the stale modes off torch's mode stack; the user's own modes stay in order."""
    depth = torch._C._len_torch_function_stack()
    modes = [torch._C._get_function_stack_at(i) for i in range(depth)]
    if not any(stale(m) for m in modes):
        return
    for _ in range(depth):
        torch._C._pop_torch_function_stack()
    for mode in modes:
        if not stale(mode):
            torch._C._push_on_torch_function_stack(mode)


def push_bottom(mode) -> None:
    """Put ``mode`` at the bottom of torch's mode stack, under the user's own modes: a
    ``with mode:`` block of theirs that ends while ours is on pops its own mode (the top),
    never ours, and ours still sees every call their modes make."""
    depth = torch._C._len_torch_function_stack()
    above = [torch._C._pop_torch_function_stack() for _ in range(depth)]
    torch._C._push_on_torch_function_stack(mode)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def reaches(t: torch.Tensor, roots: list, limit: int | None = LIMIT) -> bool:
    """Is ``t`` computed from one of ``roots`` (the model's outputs)? A walk of t's autograd
    graph down to the roots' nodes (a loss is a few nodes above the outputs); past ``limit``
    nodes, taken as connected (the window's checks then run, as before); ``limit=None``:
    the whole graph."""
    if any(t is r for r in roots):
        return True
    nodes = {r.grad_fn for r in roots if r.grad_fn is not None}
    todo, seen = [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if fn in nodes:
            return True
        seen.add(fn)
        if limit is not None and len(seen) > limit:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


__all__ = ["LIMIT", "Weak", "push_bottom", "reaches", "remove", "stale", "sweep", "weak_attribute"]
