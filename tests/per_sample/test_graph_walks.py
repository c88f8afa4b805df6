"""The autograd-graph walks visit every node once, whatever Python does with node objects.

``next_functions`` hands out a node's Python object anew once the last one died, and CPython
reuses a dead object's id. A walk that remembered bare ids of objects it let die could take
an unvisited node for a visited one and stop short: under torch 2.11 (CPU and CUDA,
2026-11-30) the loss-reach walk did, and layers of Swin-v2, DeBERTa, Data2Vec-Vision and LoHa
whose calls do not carry the batch were not sent to the fallback (einsum crashed or refused;
torch 2.13's objects happen to live longer). Each walk now holds what it met.
"""

import torch

from workbench.per_sample.derived import graph_nodes, parameters_below
from workbench.per_sample.derived import reached as reached_by
from workbench.per_sample.unseen import reached


def wide_graph(width=300, depth=4):
    """``width`` leaves, each through ``depth`` ops of its own, summed: width·depth distinct
    interior nodes, none of which Python holds once the function returns."""
    leaves = [torch.randn(3, requires_grad=True) for _ in range(width)]
    total = None
    for leaf in leaves:
        h = leaf
        for _ in range(depth):
            h = h.sin()
        total = h.sum() if total is None else total + h.sum()
    return leaves, total


def test_graph_nodes_meets_every_node_once():
    leaves, total = wide_graph()
    nodes = list(graph_nodes([total]))
    assert len({id(n) for n in nodes}) == len(nodes)
    kinds = [type(n).__name__ for n in nodes]
    assert kinds.count("SinBackward0") == 300 * 4
    assert kinds.count("AccumulateGrad") == 300


def test_every_leaf_is_reached():
    leaves, total = wide_graph()
    wanted = {id(p) for p in leaves}
    assert reached([total], wanted) == wanted
    assert reached_by([total], set()) == wanted
    few, small = wide_graph(width=20, depth=3)  # within parameters_below's MAX_NODES
    below = parameters_below(small.grad_fn, {id(p): p for p in few})
    assert below is not None and {id(p) for p in below} == {id(p) for p in few}
