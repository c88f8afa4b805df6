"""Backpropagation through time by hand: a whole recurrence as ONE autograd node.

The loops of recurrence.py let autograd record every op of every step: ~8 nodes per step
forward, ~15 kernels per step backward, each paying Python and autograd book-keeping on
tensors of a few KiB; at small batches that overhead, not arithmetic, is the time (a profile
of DPLSTM at n = 16: ~500 aten ops per step, most of them tiny). Here the forward pass runs
without autograd (bptt_forward.py), saving what the backward needs, and a hand-written
backward loop does only the sequential part of the chain rule; everything that does not
depend on the carried gradient (the gate derivatives, dX of GRU, ∂W) is computed for all T
steps at once.

Per step t, with u_t = h_{t-1} W_hhᵀ (+ b_hh) and the gate pre-activations from X_t and u_t
(cells.py has the equations; σ' = σ(1-σ), tanh' = 1 - tanh²), given h̄_t (the gradient
reaching h_t: the output's plus the one carried back from step t+1) and, for LSTM, c̄_t:

    RNN   ū_t = h̄_t ⊙ φ'_t                                        φ = tanh or relu
    LSTM  c̄ = c̄_t + h̄_t ⊙ o_t tanh'(c_t)
          ū_t = [c̄ ⊙ g σ'(i), c̄ ⊙ c_{t-1} σ'(f), c̄ ⊙ i tanh'(g), h̄_t ⊙ tanh(c_t) σ'(o)]
          c̄_{t-1} = c̄ ⊙ f
    GRU   a = (1 - z) tanh'(m)
          ū_t = h̄_t ⊙ [a u_n σ'(r), (h_{t-1} - m) σ'(z), a r]
          X̄_t = h̄_t ⊙ [a u_n σ'(r), (h_{t-1} - m) σ'(z), a]     (after the loop, all t)
    all   h̄_{t-1} = ō_{t-1} + ū_t W_hh (+ h̄_t ⊙ z for GRU)        ō: the output's gradient

For RNN and LSTM the pre-activation is X_t + u_t, so X̄ = ū. A finished sequence (packed
input, sequences.py) keeps its state: with the step's mask k ∈ {0, 1}, the cell sees k h̄_t
(and k c̄_t) and (1 - k) h̄_t passes straight to h̄_{t-1}.

Two "ports" give W_hh its gradient:

- **W port** (nobody records the part): backward returns ∂W_hh = Σ_t ū_tᵀ h_{t-1}, one
  matrix product over all n T rows, and ∂b_hh = Σ_t ū_t (GRU).
- **U port** (the einsum engine records the part): the layer first calls the hooked part once
  on all states, U = hh(H_prev) (recurrence.py explains the one-call form), and passes U in;
  backward returns Ū = (ū_t) for U, so the engine captures exactly these backprops and
  W_hh's gradient, batch and per sample, comes from the Linear rule on that one call.

The autograd loops of recurrence.py are the slow twins; tests compare both in float64 for
every cell and option. ``bptt`` is differentiable once (a backward with ``create_graph=True``
raises, naming the fix); under torch.func transforms and autocast the layer uses the loops.

Notation: n batch, T steps, H hidden size, G gate blocks, x̄ the gradient of Σ ℓ w.r.t. x.
"""

import torch

from workbench.layers.bptt_forward import FORWARDS
from workbench.per_sample.owned import only_reference

# --- backward loops: the sequential part of the chain rule -------------------------------


def _carry(dh, out_grad, pass_through):
    """ō_{t-1} (+ (1 - k) h̄_t): what h̄_{t-1} gets besides ū_t W_hh; None if nothing."""
    if pass_through is None:
        return out_grad
    kept = dh * pass_through  # a finished sequence's state passes its gradient back
    return kept if out_grad is None else kept.add_(out_grad)


def _back_step(du, W, base):
    """h̄_{t-1} = base + ū_t W_hh."""
    return torch.mm(du, W) if base is None else torch.addmm(base, du, W)


def _masks(keep, dtype):
    """(k, 1 - k) as (n, T, 1) floats, or (None, None) without a mask."""
    if keep is None:
        return None, None
    k = keep.unsqueeze(-1).to(dtype)
    return k, 1 - k


def rnn_backward(saved, W, keep, dOut, dhT, relu):
    """(Ū = X̄ (n, T, H), h̄_0)."""
    Hn = saved["Hs"][:, 1:]  # (n, T, H) h_t; at a finished step φ' is masked out below
    k, pass_through = _masks(keep, Hn.dtype)
    dU = torch.empty_like(Hn)
    dUs, Hns, Gs = dU.unbind(1), Hn.unbind(1), dOut.unbind(1)
    ks = k.unbind(1) if k is not None else None
    Ks = pass_through.unbind(1) if k is not None else None
    T = Hn.shape[1]
    dh = dhT + Gs[T - 1]
    for t in range(T - 1, -1, -1):
        d = dh if ks is None else dh * ks[t]
        if relu:  # ū_t = h̄_t ⊙ φ'_t: 1[h_t > 0] or 1 - h_t²
            du = torch.ops.aten.threshold_backward.grad_input(d, Hns[t], 0, grad_input=dUs[t])
        else:
            du = torch.ops.aten.tanh_backward.grad_input(d, Hns[t], grad_input=dUs[t])
        dh = _back_step(du, W, _carry(dh, Gs[t - 1] if t else None, Ks and Ks[t]))
    return dU, dh


def lstm_backward(saved, W, keep, dOut, dhT, dcT):
    """(Ū = X̄ (n, T, 4H), h̄_0, c̄_0).

    Ū's buffer first holds the factors ∂c/∂(i, f, g)_pre and ∂h/∂o_pre; step t multiplies
    its block by c̄ and h̄_t in place (no separate buffers for the factors).
    """
    S, TC, Cs = saved["S"], saved["TC"], saved["Cs"]
    n, T, G = S.shape
    i, f, g, o = S.chunk(4, dim=2)  # (n, T, H) each
    tanh_d, sigmoid_d = torch.ops.aten.tanh_backward, torch.ops.aten.sigmoid_backward
    A = tanh_d(o, TC)  # ∂h/∂c = σ(o) tanh'(c): fused kernels, one pass each
    dU = S.new_empty(n, T, G)
    dU4 = dU.view(n, T, 4, G // 4)
    sigmoid_d.grad_input(g, i, grad_input=dU4[:, :, 0])  # ∂c/∂i_pre = tanh(g) σ'(i)
    sigmoid_d.grad_input(Cs[:, :T], f, grad_input=dU4[:, :, 1])  # ∂c/∂f_pre = c_{t-1} σ'(f)
    tanh_d.grad_input(i, g, grad_input=dU4[:, :, 2])  # ∂c/∂g_pre = σ(i) tanh'(g)
    sigmoid_d.grad_input(TC, o, grad_input=dU4[:, :, 3])  # ∂h/∂o_pre = tanh(c) σ'(o)
    k, pass_through = _masks(keep, S.dtype)
    if k is not None:
        A = A * k
        dU4[:, :, 3] *= k
    dUs, ifg, o_bar = dU.unbind(1), dU4[:, :, :3].unbind(1), dU4[:, :, 3].unbind(1)
    As, fs, Gs = A.unbind(1), f.unbind(1), dOut.unbind(1)
    ks = k.unbind(1) if k is not None else None
    Ks = pass_through.unbind(1) if k is not None else None
    dh, dc = dhT + Gs[T - 1], dcT
    for t in range(T - 1, -1, -1):
        c_bar = torch.addcmul(dc if ks is None else dc * ks[t], dh, As[t])  # c̄
        ifg[t].mul_(c_bar.unsqueeze(1))  # ū for i, f, g
        o_bar[t].mul_(dh)  # ū for o
        dc_prev = c_bar * fs[t]  # c̄_{t-1} = c̄ ⊙ σ(f)
        if Ks is not None:
            dc_prev.addcmul_(dc, Ks[t])
        dh = _back_step(dUs[t], W, _carry(dh, Gs[t - 1] if t else None, Ks and Ks[t]))
        dc = dc_prev
    return dU, dh, dc


def gru_backward(saved, W, keep, dOut, dhT):
    """(Ū (n, T, 3H), X̄ (n, T, 3H), h̄_0)."""
    RZ, M, U, Hs = saved["RZ"], saved["M"], saved["U"], saved["Hs"]
    n, T, G = U.shape
    H = G // 3
    r, z = RZ.chunk(2, dim=2)
    tanh_d, sigmoid_d = torch.ops.aten.tanh_backward, torch.ops.aten.sigmoid_backward
    a = tanh_d(1 - z, M)  # ∂h/∂(m's pre-activation) = (1 - z) tanh'(m)
    dU = U.new_empty(n, T, G)  # first the factors ∂h/∂u for r, z, n; times h̄_t in the loop
    dU4 = dU.view(n, T, 3, H)
    sigmoid_d.grad_input(a * U[..., 2 * H:], r, grad_input=dU4[:, :, 0])  # a u_n σ'(r)
    sigmoid_d.grad_input(Hs[:, :T] - M, z, grad_input=dU4[:, :, 1])  # (h_{t-1} - m) σ'(z)
    torch.mul(a, r, out=dU4[:, :, 2])
    k, pass_through = _masks(keep, U.dtype)
    Z = z
    if k is not None:
        dU4 *= k.unsqueeze(2)
        a, Z = a * k, torch.addcmul(pass_through, z, k)  # z k + 1 - k
    DH = U.new_empty(n, T, H)  # h̄_t for every t
    dUs, dU4s, DHs = dU.unbind(1), dU4.unbind(1), DH.unbind(1)
    Zs, Gs = Z.unbind(1), dOut.unbind(1)
    torch.add(dhT, Gs[T - 1], out=DHs[T - 1])
    for t in range(T - 1, 0, -1):
        dU4s[t].mul_(DHs[t].unsqueeze(1))  # ū_t
        torch.addcmul(Gs[t - 1], DHs[t], Zs[t], out=DHs[t - 1]).addmm_(dUs[t], W)  # h̄_{t-1}
    dU4s[0].mul_(DHs[0].unsqueeze(1))
    dh0 = torch.addmm(DHs[0] * Zs[0], dUs[0], W)
    dX = torch.cat([dU[..., :2 * H], DH * a], dim=2)  # r, z as ū; n without the factor r
    return dU, dX, dh0


# --- the autograd node ---------------------------------------------------------------------

class BPTT(torch.autograd.Function):
    """(X, U or W_hh, b_hh, h_0[, c_0]) -> (outputs (n, T, H), h_T[, c_T]), one node.

    ``saved`` is the forward loop's result, computed before (the U port needs its states).
    """

    @staticmethod
    def forward(ctx, mode, keep, saved, X, U, W, b, h0, c0):
        ctx.mode, ctx.names = mode, sorted(saved)
        ctx.save_for_backward(W, keep, *(saved[name] for name in ctx.names))
        T = X.shape[1]
        if mode == "LSTM":  # outputs are copies: an in-place change leaves the saved intact
            Hp, hT = saved["Hp"], saved["hT"]  # h_0..h_{T-1}, h_T (bptt_forward.lstm_forward)
            return (torch.cat([Hp[:, 1:], hT.unsqueeze(1)], dim=1), hT.clone(),
                    saved["Cs"][:, T].clone())
        Hs = saved["Hs"]
        return Hs[:, 1:].clone(), Hs[:, T].clone()

    @staticmethod
    def backward(ctx, dOut, dhT, dcT=None):
        if torch.is_grad_enabled():  # create_graph=True: a graph of this backward is wanted
            raise RuntimeError(
                "the DP recurrent layers' hand-written backward through time is differentiable "
                "once, and create_graph=True asks for more (e.g. a double backward); set "
                "layer.backward_through_time = 'autograd' on the DPRNN/DPGRU/DPLSTM to use "
                "autograd's loop instead")
        W, keep, *tensors = ctx.saved_tensors
        saved = dict(zip(ctx.names, tensors))
        dc0 = None
        if ctx.mode == "LSTM":
            dU, dh0, dc0 = lstm_backward(saved, W, keep, dOut, dhT, dcT)
            dX = dU
        elif ctx.mode == "GRU":
            dU, dX, dh0 = gru_backward(saved, W, keep, dOut, dhT)
        else:
            dU, dh0 = rnn_backward(saved, W, keep, dOut, dhT, relu=ctx.mode == "RNN_RELU")
            dX = dU
        need = ctx.needs_input_grad  # mode, keep, saved, X, U, W, b, h0, c0
        dW = db = None
        if need[5]:  # W port: Σ_t ū_tᵀ h_{t-1}, all n T rows in one product
            dW = dU.flatten(0, 1).t() @ previous_states(saved).flatten(0, 1)
        if need[6]:
            db = dU.sum(dim=(0, 1))
        return (None, None, None, dX if need[3] else None, dU if need[4] else None, dW, db,
                dh0 if need[7] else None, dc0 if need[8] else None)


def previous_states(saved) -> torch.Tensor:
    """H_prev (n, T, H) = [h_0, ..., h_{T-1}]: the LSTM loop keeps it as one contiguous block
    (``Hp``, no copy where it is folded to (n T, H)); the others as a view of Hs."""
    return saved["Hp"] if "Hp" in saved else saved["Hs"][:, :-1]


def fusable(*tensors) -> bool:
    """Whether ``bptt`` may run: not under torch.func transforms (vmap, grad) or autocast,
    where the layer uses the autograd loops of recurrence.py."""
    tensors = [t for t in tensors if t is not None]
    if any(torch.is_autocast_enabled(kind) for kind in {t.device.type for t in tensors}):
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not any(wrapped(t) for t in tensors)


def run_bptt(mode, X, hh, state, valid=None, one_call=False):
    """Outputs (n, T, H) and the final state, like ``recurrence.run_per_step``, as one node.

    ``one_call``: the U port, with one (hooked) call of hh on all T states; else the W port.
    """
    W, b = hh.weight, hh.bias
    with torch.no_grad():
        saved = FORWARDS[mode](X, W, b, state, valid)
    if one_call:
        U = hh(previous_states(saved))  # (n, T, G H) = H_prev W_hhᵀ (+ b_hh), one hooked call
        W, b = W.detach(), None  # a constant of the backward: W_hh's gradient comes via U
        if only_reference(U):  # BPTT takes U for its gradient edge only, never its values:
            U.untyped_storage().resize_(0)  # (n, T, G H) freed before the step's peak
    else:
        U = None
    c0 = state[1] if mode == "LSTM" else None
    out, *final = BPTT.apply(mode, valid, saved, X, U, W, b, state[0], c0)
    return out, tuple(final)


__all__ = ["BPTT", "fusable", "gru_backward", "lstm_backward", "previous_states", "rnn_backward",
           "run_bptt"]
