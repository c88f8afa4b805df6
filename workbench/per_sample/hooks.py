"""Capturing what a grad sampler needs: each layer's inputs and the gradient of its output.

The Opacus paper (Yousefpour et al. 2021, arXiv 2109.12298, §2 and Appendix B, Eq. 4-5)
obtains per-sample gradients from two quantities per layer and call:

- the *activations* a (the layer's inputs), kept by a forward hook;
- the *backprops* b = ∂(Σ_i ℓ_i)/∂o, the gradient w.r.t. the layer's output o. Its row i
  equals ∂ℓ_i/∂o_i because samples do not mix ("highway gradients").

The forward hook also keeps o's autograd *edge* (``torch.autograd.graph.get_gradient_edge``):
the point of the graph where o's gradient arrives. ``ActivationRecorder.backward`` then asks
autograd for the gradients at all those edges in one pass. Two things follow:

- only the highway gradients are computed: no layer computes its (batch-summed) weight
  gradient, which the per-sample rule replaces anyway;
- an in-place change of o after the layer (say ``ReLU(inplace=True)``) moves o to a new
  graph node, but the edge taken before it still names o's original value.

When someone else runs the backward pass (the ordinary training loop's ``loss.backward()``,
used by ``dpsgd``), ``capture="hooks"`` instead registers a tensor hook on o in the forward
hook; a tensor hook registered before an in-place change of o also sees o's original value.

A module called several times in one forward pass (weight sharing) gets one ``LayerCall``
per call; the caller sums the per-sample gradients of the calls.

Nothing is left behind: ``ActivationRecorder`` is a context manager that removes every hook
on exit, also when the forward or backward pass raises.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class LayerCall:
    """One call of a layer: its inputs, its output's edge, and (after backward) b."""

    args: tuple
    kwargs: dict
    edge: GradientEdge
    backprops: torch.Tensor | None = None  # (n, *output.shape[1:]); None: output unused


@dataclass
class ActivationRecorder:
    """Records a ``LayerCall`` per call of each of ``layers`` (``{path: module}``)."""

    layers: dict[str, nn.Module]
    capture: str = "edges"  # "edges": self.backward() fills b; "hooks": any backward pass does
    calls: dict[str, list[LayerCall]] = field(default_factory=dict)
    untracked: dict[str, str] = field(default_factory=dict)  # path -> type of a non-Tensor output
    recording: bool = True  # False inside ``paused()``: the samplers' own layer calls
    _handles: list = field(default_factory=list)

    def __enter__(self):
        for path, layer in self.layers.items():
            self.calls[path] = []
            hook = self._forward_hook(self.calls[path], path)
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    def _forward_hook(self, calls: list[LayerCall], path: str):
        def hook(module, args, kwargs, output):
            if not self.recording:
                return None
            if isinstance(output, torch.Tensor):
                if output.requires_grad:  # else not differentiable here: nothing to sample
                    call = LayerCall(args=args, kwargs=kwargs, edge=get_gradient_edge(output))
                    calls.append(call)
                    if self.capture == "hooks":
                        output.register_hook(lambda grad: setattr(call, "backprops", grad))
            else:
                untracked[path] = type(output).__name__  # the caller decides if that is fatal
            return None

        untracked = self.untracked
        return hook

    @contextmanager
    def paused(self):
        """Record nothing inside (a sampler may call the layer itself, e.g. under vmap)."""
        self.recording = False
        try:
            yield self
        finally:
            self.recording = True

    def clear(self) -> None:
        """Forget the recorded calls (their activations and backprops), keep the hooks."""
        for calls in self.calls.values():
            calls.clear()
        self.untracked.clear()

    def all_calls(self) -> list[LayerCall]:
        return [call for calls in self.calls.values() for call in calls]

    def backward(self, total_loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Fill in ``backprops`` of every recorded call: ∂ total_loss / ∂o, one autograd pass."""
        calls = self.all_calls()
        if not calls:
            return
        grads = torch.autograd.grad(total_loss, [c.edge for c in calls], allow_unused=True,
                                    retain_graph=retain_graph)
        for call, grad in zip(calls, grads):
            call.backprops = grad
