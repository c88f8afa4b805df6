"""The loop over time of one layer and direction, in two forms that compute the same function.

Given the input projections X (n, T, G H) of all steps (one hooked ``InputProjection`` call),
a step function (cells.py) and the ``RecurrentProjection`` part hh (u = h W_hhᵀ + b_hh):

**per step** (``run_per_step``): u_t = hh(h_{t-1}) is one hooked call per step, and the
engine sums the T per-call gradients, Σ_t ū_t h_{t-1}ᵀ ("time-summing", as Opacus'
RNNLinear; Opacus blog "Efficient per-sample gradient computation for more layers"). Fewest
operations, but recording costs T outer products of size (n, G H, H) and T sums.

**one call** (``run_one_call``): the same sum as one batched product, from a single hooked
call hh(H_prev) on all T states at once, H_prev = (h_0, ..., h_{T-1}) (n, T, H). The states
are not known before the loop that makes them, so the loop runs twice:

1. without autograd, to get the values H_prev;
2. with autograd, replaying the loop with the precomputed U = hh(H_prev) (n, T, G H):

       u_t = U_t + (h_{t-1} - sg(h_{t-1})) W̄_hhᵀ         sg: stop-gradient, W̄: W_hh detached

   The correction is exactly zero in value, so u_t = U_t; in the backward pass it sends
   ū_t W_hh to h_{t-1}, the gradient through time, while W_hh (and b_hh) get theirs only
   through U: Σ_t ū_t h_{t-1}ᵀ, read by the Linear rule in one bmm.

Both forms are tested against each other and against micro-batching. ``DPRNNBase`` picks the
one-call form when something records the part (the einsum engine's forward hooks), else the
per-step form; ``recurrent_calls`` on the layer forces either.

These loops let autograd record every op of every step. By default the layers run the same
recurrence as one autograd node with a hand-written backward (bptt.py, whose "U port" is the
one-call form above); these loops are its slow twin, used with
``backward_through_time = "autograd"``, under torch.func transforms and under autocast, and for
per-step recorded calls (``recurrent_calls = "per_step"`` while recorded).

Notation: n batch, T steps, H hidden size, G gate blocks, ū backprops of u.
"""

import torch


def advance(new: tuple, old: tuple, valid: torch.Tensor | None, t: int) -> tuple:
    """The state after step t: ``new``, except rows whose sequence has ended keep ``old``."""
    if valid is None:
        return new
    keep = valid[:, t:t + 1]  # (n, 1)
    return tuple(torch.where(keep, a, b) for a, b in zip(new, old))


def run_per_step(step, X, hh, state, valid=None):
    """Outputs (n, T, H) and the final state; hh is called (and hooked) once per step."""
    outputs = []
    # unbind, not X[:, t]: the backward of T slices would write T full-size zero tensors
    for t, X_t in enumerate(X.unbind(dim=1)):
        state = advance(step(X_t, hh, state), state, valid, t)
        outputs.append(state[0])
    return torch.stack(outputs, dim=1), state


def run_one_call(step, X, hh, state, valid=None):
    """Same result as ``run_per_step``; hh is called (and hooked) once, on all T states."""
    with torch.no_grad():  # pass 1: the values h_0, ..., h_{T-1}, as constants
        entering, s = [], state
        for t, X_t in enumerate(X.unbind(dim=1)):
            entering.append(s[0])
            s = advance(step(X_t, hh.forward, s), s, valid, t)  # .forward: not recorded
        H_prev = torch.stack(entering, dim=1)  # (n, T, H); a given h_0 too: no path back
    U = hh(H_prev)  # (n, T, G H): H_prev W_hhᵀ (+ b_hh), one hooked call
    W = hh.weight.detach()
    outputs = []
    for t, (X_t, U_t) in enumerate(zip(X.unbind(dim=1), U.unbind(dim=1))):  # pass 2
        state = advance(step(X_t, replayed(U_t, W), state), state, valid, t)
        outputs.append(state[0])
    return torch.stack(outputs, dim=1), state


def replayed(U_t: torch.Tensor, W: torch.Tensor):
    """A stand-in for hh at step t: U_t in value, W in the gradient w.r.t. h."""
    def project(h, add=None):
        base = U_t if add is None else U_t + add
        if not h.requires_grad:
            return base  # nothing to carry back (e.g. a constant initial state)
        return torch.addmm(base, h - h.detach(), W.t())  # base + 0, ∂/∂h = W

    return project


__all__ = ["advance", "replayed", "run_one_call", "run_per_step"]
