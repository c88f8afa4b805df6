"""call_leaves / leaves == tree_flatten's leaves (same objects, same order) on every kind of
argument a torch op takes, the shortcut's types and the ones that must take the walk."""

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from workbench.per_sample.leaves import call_leaves, leaves

Pair = namedtuple("Pair", "a b")


class Sub(torch.Tensor):
    pass


t, p = torch.ones(2, 3), nn.Parameter(torch.zeros(3))
CALLS = [
    ((t, p, 2, 0.5, True, None), {}),
    ((t,), {"dim": 1, "keepdim": False, "dtype": torch.float64}),
    ((t, slice(0, 1), ...), {"out": None}),
    ((t, torch.Size([3, 2])), {}),  # pytree flattens a Size into its ints
    (([t, p], 0), {}),  # torch.cat([w1, w2])
    ((t,), {"weights": (p, t)}),
    ((Pair(t, 1), OrderedDict(x=p)), {}),
    ((t.as_subclass(Sub), 3), {"device": torch.device("cpu"), "layout": torch.strided}),
    ((), {}),
    (("mean", 1 + 2j, torch.contiguous_format), {}),
]


@pytest.mark.parametrize("args,kwargs", CALLS)
def test_call_leaves_are_tree_flattens(args, kwargs):
    want = tree_flatten((args, kwargs))[0]
    got = call_leaves(args, kwargs)
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("tree", [t, p, 3, None, (t, p), [t, [p]], {"a": t}, torch.Size([2]),
                                  Pair(t, p), t.as_subclass(Sub)])
def test_leaves_are_tree_flattens(tree):
    want = tree_flatten(tree)[0]
    got = leaves(tree)
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want))
