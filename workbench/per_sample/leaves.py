"""The leaves of a torch call's arguments, with the pytree walk only where there is a tree.

A ``TorchFunctionMode`` (the use tracker, the loss window, the batch follower) sees every op
of the user's code; reading an op's tensors with ``torch.utils._pytree.tree_flatten`` walks
``(args, kwargs)`` node by node in Python, several microseconds per op. Most ops take
tensors, numbers and dtypes only: their leaves are the arguments themselves, in order.

Invariant: ``call_leaves(args, kwargs) == tree_flatten((args, kwargs))[0]`` (same objects,
same order) for every call. The shortcut applies only when every argument's *exact* type is
a pytree leaf type; anything else (lists, tuples, dicts, namedtuples, ``torch.Size``, which
pytree flattens into its ints, a tensor subclass, a registered node) takes ``tree_flatten``.
"""

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

# exact types that tree_flatten returns as one leaf (torch.Size is not one: it is a node)
LEAF_TYPES = frozenset({torch.Tensor, nn.Parameter, int, float, bool, complex, str,
                        type(None), torch.dtype, torch.device, torch.layout,
                        torch.memory_format, slice, type(Ellipsis)})


def call_leaves(args, kwargs) -> list:
    """``tree_flatten((args, kwargs))[0]``, without the walk when every argument is a leaf."""
    for a in args:
        if type(a) not in LEAF_TYPES:
            return tree_flatten((args, kwargs))[0]
    if kwargs:
        for v in kwargs.values():
            if type(v) not in LEAF_TYPES:
                return tree_flatten((args, kwargs))[0]
        return [*args, *kwargs.values()]
    return list(args)


def leaves(tree) -> list:
    """``tree_flatten(tree)[0]``; one leaf without the walk."""
    if type(tree) in LEAF_TYPES:
        return [tree]
    return tree_flatten(tree)[0]


__all__ = ["LEAF_TYPES", "call_leaves", "leaves"]
