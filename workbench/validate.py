"""Model validation: what stops a model from getting correct per-sample gradients, and fixes.

``validate_model(model)`` lists every problem with its module path; ``fix_model(model)``
returns a fixed copy (the original is left untouched):

- BatchNorm (and SyncBatchNorm) normalise with batch statistics, mixing samples: replaced by
  GroupNorm with gcd(32, C) groups, the affine weights copied (the DP-SGD practice of
  Opacus' ModuleValidator; Yousefpour et al. 2021, arXiv 2109.12298, §2).
- InstanceNorm with ``track_running_stats=True``: the running statistics mix samples;
  replaced by the same layer without running statistics.
- ``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` and ``nn.MultiheadAttention`` run fused kernels whose
  matrix products no hook can see (and return tuples, which the einsum engine does not
  record): replaced by their drop-in twins in ``wb.layers`` (DPRNN, DPGRU, DPLSTM,
  DPMultiheadAttention), the weights copied, so outputs are unchanged (Opacus blog
  "Efficient per-sample gradient computation for more layers", RNN and attention sections).
- A layer with trainable parameters and no grad sampler is reported as a note: the einsum
  method still works (vmap on that layer) but is slower.
"""

import copy
import math
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from workbench.errors import UnsupportedLayerError
from workbench.layers import DP_REPLACEMENTS, dp_replacement
from workbench.per_sample.checks import frozen_statistics, sample_mixing_problem
from workbench.per_sample.registry import find_grad_sampler

FUSED = (nn.RNNBase, nn.MultiheadAttention)
"""Layer types computed by fused kernels that hooks cannot look into."""


@dataclass(frozen=True)
class Problem:
    """One finding of ``validate_model``: where, what, and whether it blocks DP training."""

    path: str
    layer: str
    message: str
    blocking: bool = True

    def __str__(self):
        return f"{self.layer} at {self.path or '<model>'}: {self.message}"


def fused_layer_problem(module: nn.Module) -> str | None:
    """Why a trainable fused RNN / attention layer blocks per-sample gradients, or None.

    A frozen one is fine: nothing of it needs a per-sample gradient.
    """
    if not isinstance(module, FUSED) or not any(p.requires_grad for p in module.parameters()):
        return None
    why = "runs a fused kernel whose matrix products hooks cannot see"
    twin = DP_REPLACEMENTS.get(type(module))
    if twin is None:
        return f"{why}; this subclass has no drop-in twin: rebuild it on the wb.layers classes"
    if getattr(module, "proj_size", 0):
        return (f"{why}, and its proj_size={module.proj_size} is not supported by "
                f"wb.layers.{twin.__name__}; use proj_size=0 (plus a Linear layer)")
    return (f"{why}; use wb.fix_model(model) to replace it with wb.layers.{twin.__name__} "
            f"(same parameters, same outputs)")


def _inside(path: str, parents: list[str]) -> bool:
    return any(parent == "" or path.startswith(f"{parent}.") for parent in parents)


INPLACE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Hardtanh,
           nn.Hardswish, nn.Hardsigmoid, nn.SiLU, nn.Mish, nn.Threshold, nn.Dropout,
           nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def validate_model(model: nn.Module) -> list[Problem]:
    """Every problem that stops (or slows) per-sample gradients, with module paths.

    Blocking: layers that mix samples, fused torch.nn recurrent/attention layers. Notes
    (``blocking=False``): layers without a grad sampler (vmap fallback), a model in eval mode,
    in-place activations.
    """
    problems = []
    if not model.training:
        frozen = any(isinstance(m, _BatchNorm) for m in model.modules())
        problems.append(Problem("", type(model).__name__, (
            "is in eval mode: dropout is off and DP training would not train what you "
            "evaluate; call model.train() before training" + (
                ", then .eval() on each BatchNorm whose statistics you keep frozen (in "
                "training mode it is refused)" if frozen else "")), blocking=False))
    fused_paths = []  # a fused layer is one problem: its children are replaced with it
    for path, module in model.named_modules():
        if _inside(path, fused_paths):
            continue
        fused = fused_layer_problem(module)
        if fused:
            problems.append(Problem(path, type(module).__name__, fused))
            fused_paths.append(path)
            continue
        if isinstance(module, INPLACE) and getattr(module, "inplace", False):
            problems.append(Problem(path, type(module).__name__, (
                "is in-place: the workbench's hooks are safe (they record the value before "
                "the in-place change), but tools built on register_full_backward_hook (e.g. "
                "Opacus' hooks mode) fail on it; inplace=False is portable"), blocking=False))
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


def _replacement(module: nn.Module, num_groups=None) -> nn.Module | None:
    if type(module) in DP_REPLACEMENTS:
        return dp_replacement(module)  # raises UnsupportedLayerError for LSTM(proj_size > 0)
    if isinstance(module, _BatchNorm) and not frozen_statistics(module):  # (frozen: kept,
        # it mixes nothing; replaced until 2026-11-30, its pre-trained statistics lost)
        extra = _added_to_batch_norm(module)
        C = module.num_features
        G = math.gcd(32, C) if num_groups is None else num_groups
        if C % G:
            raise ValueError(f"num_groups={num_groups!r} does not divide the {C} channels of "
                             f"{type(module).__name__}; choose a divisor of {C}")
        gn = nn.GroupNorm(G, C, eps=module.eps, affine=module.affine)
        if module.affine:
            gn.weight.data.copy_(module.weight.data)
            gn.bias.data.copy_(module.bias.data)
        gn = gn.to(device=module.weight.device if module.affine else None)
        if extra is None:
            return gn
        then = GroupNormThen(G, C, eps=module.eps, affine=module.affine)  # timm's norm-act:
        then.load_state_dict(gn.state_dict())  # its drop, then its act, kept by name
        for name in extra:
            then.add_module(name, copy.deepcopy(getattr(module, name)))
        return then
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        fixed = copy.deepcopy(module)
        fixed.track_running_stats = False
        fixed.running_mean = fixed.running_var = fixed.num_batches_tracked = None
        return fixed
    return None


NORM_ACT = ("drop", "act")  # timm's BatchNormAct2d: batch_norm, then self.drop, self.act
NORM_ACT_CLASSES = ("BatchNormAct2d", "SyncBatchNormAct")  # timm's, whose forward is that


class GroupNormThen(nn.GroupNorm):
    """A GroupNorm followed by the submodules it holds (``drop``, then ``act``), as timm's
    GroupNormAct: what ``fix_model`` puts in place of timm's BatchNormAct2d, its parameters
    keeping their names (``norm.weight``, not ``norm.0.weight``: a state dict or a parameter
    group chosen by name still fits). Its per-sample rule is found by behaviour
    (``rules/norm_activation.py``)."""

    def forward(self, x):
        x = super().forward(x)
        for name in NORM_ACT:
            if name in self._modules:
                x = self._modules[name](x)
        return x


def _added_to_batch_norm(module: nn.Module) -> tuple[str, ...] | None:
    """None for a BatchNorm that computes only torch's batch norm; the names of the modules
    to run after a GroupNorm for timm's ``BatchNormAct2d`` (its forward: the batch norm, then
    ``self.drop``, then ``self.act``; its ``SyncBatchNormAct`` likewise);
    ``UnsupportedLayerError`` for any other subclass with
    a forward or submodules of its own, which a GroupNorm alone would drop (timm's
    BatchNormAct2d lost its activation, silently, in 27 of RegNetX-002's 44 norms until
    2026-11-30: the fixed model computed another function)."""
    owner = next(c for c in type(module).__mro__ if "forward" in c.__dict__)
    children = tuple(name for name, _ in module.named_children())
    if owner.__module__.startswith("torch.nn") and not children:
        return None
    if owner.__module__.startswith("timm.") and owner.__name__ in NORM_ACT_CLASSES \
            and set(children) <= set(NORM_ACT):
        return tuple(name for name in NORM_ACT if name in children)
    own = [] if owner.__module__.startswith("torch.nn") else ["its own forward"]
    own += [f"submodules {', '.join(children)}"] if children else []
    raise UnsupportedLayerError(
        f"{type(module).__name__} is a BatchNorm that computes more than torch's batch norm "
        f"({' and '.join(own)}): a GroupNorm in its place would drop that, and fix_model "
        f"changes no model's function silently. Build the model with a per-sample norm layer "
        f"instead (timm: norm_layer='groupnorm', or GroupNormAct), or replace this layer by "
        f"hand")


def _like(original: nn.Module, replacement: nn.Module) -> nn.Module:
    """The replacement with the original's dtype, device, training mode and frozen parameters
    (by name where the names match; all frozen when the original's all were)."""
    tensors = [t for t in (*original.parameters(), *original.buffers()) if t.is_floating_point()]
    if tensors:
        replacement = replacement.to(device=tensors[0].device, dtype=tensors[0].dtype)
    trainable = {name: p.requires_grad for name, p in original.named_parameters()}
    all_frozen = bool(trainable) and not any(trainable.values())
    for name, p in replacement.named_parameters():
        p.requires_grad_(trainable.get(name, not all_frozen))
    return replacement.train(original.training)


def fix_model(model: nn.Module, num_groups: int | None = None) -> nn.Module:
    """A copy of ``model`` with every sample-mixing layer replaced (see the module docstring).

    BatchNorm becomes GroupNorm with ``num_groups`` groups (default gcd(32, C)), unless its
    statistics are frozen (eval mode, running statistics): it mixes nothing then. Each
    replacement keeps the dtype, device, training mode and frozen parameters of what it
    replaces.
    """
    model = copy.deepcopy(model)
    replacement = _replacement(model, num_groups)
    if replacement is not None:
        return _like(model, replacement)
    made: dict[int, nn.Module] = {}  # id(replaced) -> its one replacement: a module reached
    # by several paths (an alias attribute, one BatchNorm shared by two blocks) is replaced
    # at every one by the same new module, so the sharing stays (until 2026-11-29 only its
    # first path was: the forward still ran the BatchNorm through the others)
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) not in made:
            try:
                replacement = _replacement(module, num_groups)
            except UnsupportedLayerError as err:
                raise UnsupportedLayerError(f"{path or '<model>'}: {err}") from None
            if replacement is None:
                continue
            made[id(module)] = _like(module, replacement)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, made[id(module)])
    return model


__all__ = ["FUSED", "INPLACE", "Problem", "fix_model", "fused_layer_problem", "validate_model"]
