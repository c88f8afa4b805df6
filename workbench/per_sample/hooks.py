"""Capturing what a grad sampler needs: each layer's inputs and the gradient of its output.

The Opacus paper (Yousefpour et al. 2021, arXiv 2109.12298, §2 and Appendix B, Eq. 4-5)
obtains per-sample gradients from two quantities per layer and call:

- the *activations* a (the layer's inputs), kept by a forward hook;
- the *backprops* b = ∂(Σ_i ℓ_i)/∂o, the gradient w.r.t. the layer's output o. Its row i
  equals ∂ℓ_i/∂o_i because samples do not mix ("highway gradients").

We capture b with a tensor hook on o, registered in the forward hook. A tensor hook
registered before an in-place modification of o (say a later ``ReLU(inplace=True)``)
still receives the gradient of o's original value, so in-place activations are safe.

A module called several times in one forward pass (weight sharing) gets one ``LayerCall``
per call; the per-sample gradients of the calls are summed by the caller.

Nothing is left behind: ``ActivationRecorder`` is a context manager that removes every hook
on exit, also when the forward or backward pass raises.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LayerCall:
    """One call of a layer: its positional inputs, keyword inputs and output gradient."""

    args: tuple
    kwargs: dict
    backprops: torch.Tensor | None = None  # filled in during the backward pass


@dataclass
class ActivationRecorder:
    """Records a ``LayerCall`` per call of each of ``layers`` (``{path: module}``)."""

    layers: dict[str, nn.Module]
    calls: dict[str, list[LayerCall]] = field(default_factory=dict)
    _handles: list = field(default_factory=list)

    def __enter__(self):
        for path, layer in self.layers.items():
            self.calls[path] = []
            hook = self._forward_hook(self.calls[path])
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    @staticmethod
    def _forward_hook(calls: list[LayerCall]):
        def hook(module, args, kwargs, output):
            if not (isinstance(output, torch.Tensor) and output.requires_grad):
                return None  # not differentiable here (e.g. under no_grad): nothing to sample
            call = LayerCall(args=args, kwargs=kwargs)
            calls.append(call)

            def keep_backprops(grad):
                call.backprops = grad  # (n, *output.shape[1:])

            output.register_hook(keep_backprops)
            return None

        return hook
