"""Model validation: what stops a model from getting correct per-sample gradients, and fixes.

``validate_model(model)`` lists every problem with its module path; ``fix_model(model)``
returns a fixed copy (the original is left untouched):

- BatchNorm (and SyncBatchNorm) normalise with batch statistics, mixing samples: replaced by
  GroupNorm with gcd(32, C) groups, the affine weights copied (the DP-SGD practice of
  Opacus' ModuleValidator; Yousefpour et al. 2021, arXiv 2109.12298, §2).
- InstanceNorm with ``track_running_stats=True``: the running statistics mix samples;
  replaced by the same layer without running statistics.
- A layer with trainable parameters and no grad sampler is reported as a note: the einsum
  method still works (vmap on that layer) but is slower.
"""

import copy
import math
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from workbench.per_sample.checks import sample_mixing_problem
from workbench.per_sample.registry import find_grad_sampler


@dataclass(frozen=True)
class Problem:
    """One finding of ``validate_model``: where, what, and whether it blocks DP training."""

    path: str
    layer: str
    message: str
    blocking: bool = True

    def __str__(self):
        return f"{self.layer} at {self.path or '<model>'}: {self.message}"


def validate_model(model: nn.Module) -> list[Problem]:
    """Every problem that stops (or slows) per-sample gradients, with module paths."""
    problems = []
    for path, module in model.named_modules():
        mixing = sample_mixing_problem(module)
        if mixing:
            problems.append(Problem(path, type(module).__name__, mixing))
        elif (any(p.requires_grad for p in module.parameters(recurse=False))
              and find_grad_sampler(module) is None):
            problems.append(Problem(
                path, type(module).__name__,
                "has no registered grad sampler; einsum falls back to vmap on this layer "
                "(register one with @wb.register_grad_sampler)", blocking=False))
    return problems


def _replacement(module: nn.Module) -> nn.Module | None:
    if isinstance(module, _BatchNorm):
        C = module.num_features
        gn = nn.GroupNorm(math.gcd(32, C), C, eps=module.eps, affine=module.affine)
        if module.affine:
            gn.weight.data.copy_(module.weight.data)
            gn.bias.data.copy_(module.bias.data)
        return gn.to(device=module.weight.device if module.affine else None)
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        fixed = copy.deepcopy(module)
        fixed.track_running_stats = False
        fixed.running_mean = fixed.running_var = fixed.num_batches_tracked = None
        return fixed
    return None


def fix_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every sample-mixing layer replaced (see the module docstring)."""
    model = copy.deepcopy(model)
    replacement = _replacement(model)
    if replacement is not None:
        return replacement
    for path, module in list(model.named_modules()):
        replacement = _replacement(module)
        if replacement is not None:
            parent_path, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent_path), name, replacement)
    return model
