"""The forward loop of the DP recurrent layers, without autograd: outputs, and what bptt.py's
hand-written backward reads.

One step at a time from the input projections X (n, T, G H): one matrix product and a few
elementwise ops a step (the cell equations are cells.py's), written into preallocated
(n, T, ...) buffers: the states h_0..h_T (and c_0..c_T), the gate activations, tanh(c_t).
A mask (packed sequences, sequences.py) keeps a finished sequence's state.

Measured alternative, not kept: the states from torch.nn's fused kernel (``torch._VF.lstm``)
and the gates recomputed for all T at once cost as much as this loop (0.93x to 1.3x of it
for a whole training step, 1-thread CPU, H = 64, n = 8 to 128), for a second code path.

Notation: n batch, T steps, H hidden size, G gate blocks, h hidden state, c cell state,
σ the logistic sigmoid.
"""

import torch

FAST_TANH_MIN = 8192
"""From this many float32 elements on, ``tanh`` computes 2 σ(2x) - 1 (three passes of fast
kernels) instead of ``torch.tanh`` (one slow pass): measured on a 1-thread AVX-512 CPU, torch
2.13, 4-5x faster at 16k-500k elements, slower below ~4k. Its error is at most ~2e-7
absolute (a few float32 ulps of 1; tanh lies in [-1, 1]), so outputs agree with torch.nn's to
float32 precision; float64 always uses ``torch.tanh``."""


def tanh(x, out=None):
    """tanh(x), written to ``out`` if given (may be x itself)."""
    if x.dtype != torch.float32 or x.numel() < FAST_TANH_MIN:
        return torch.tanh(x, out=out)
    s = torch.mul(x, 2).sigmoid_()
    return torch.mul(s, 2, out=out).sub_(1)


# --- forward loops (no autograd): outputs, and what the backward needs -------------------


def steps(x: torch.Tensor, *blocks: int) -> list:
    """Per-step views of x (n, T, ...): ``x[:, t]`` for every t, or, given block sizes, of
    each block of the last dim. Made once before a loop (unbind is one call for all T): a
    slice or chunk inside the loop costs ~1-2 µs a step, the price of a small op."""
    if not blocks:
        return x.unbind(1)
    return [part.unbind(1) for part in x.split(list(blocks), dim=-1)]


def rnn_forward(X, W, b, state, keep, relu):
    """Hs (n, T+1, H) = [h_0, h_1, ..., h_T]."""
    (h0,) = state
    n, T, _ = X.shape
    Hs = X.new_empty(n, T + 1, h0.shape[1])
    Hs[:, 0] = h0
    hs, Wt = steps(Hs), W.t()
    act = torch.relu_ if relu else (lambda v: tanh(v, out=v))
    for t, X_t in enumerate(steps(X)):
        if keep is None:
            act(torch.addmm(X_t, hs[t], Wt, out=hs[t + 1]))  # φ(X_t + h W_hhᵀ)
        else:
            torch.where(keep[:, t:t + 1], act(torch.addmm(X_t, hs[t], Wt)), hs[t], out=hs[t + 1])
    return {"Hs": Hs}


def lstm_forward(X, W, b, state, keep):
    """Hp (n, T, H) = [h_0, ..., h_{T-1}] and hT (n, H) = h_T; Cs (n, T+1, H) with c_0;
    S (n, T, 4H): σ(i), σ(f), tanh(g), σ(o); TC (n, T, H): tanh(c'_t) of the cell's new state
    (before a mask keeps the old one).

    The previous states are one contiguous block, not a view Hs[:, :-1] of (n, T+1, H): the
    DP layer's hooked call U = Hp W_hhᵀ (``bptt.run_bptt``) and the W port's Ūᵀ Hp then fold
    it to (n T, H) with no copy (a view would be copied, and the copy kept by autograd for
    W_hh's gradient: 25 MiB at n = 256, T = 256, H = 100)."""
    h0, c0 = state
    n, T, G = X.shape
    H = G // 4
    Hp, hT, Cs = X.new_empty(n, T, H), X.new_empty(n, H), X.new_empty(n, T + 1, H)
    S, TC = X.new_empty(n, T, G), X.new_empty(n, T, H)
    hs = [*steps(Hp), hT]  # h_t for t = 0..T
    hs[0].copy_(h0)
    Cs[:, 0] = c0
    cs, Ss, tcs, Wt = steps(Cs), steps(S), steps(TC), W.t()
    i_s, f_s, g_s, o_s = steps(S, H, H, H, H)
    pre = X.new_empty(n, G)  # one step's gate pre-activations, reused
    pre_g = pre[:, 2 * H:3 * H]
    for t, X_t in enumerate(steps(X)):
        torch.addmm(X_t, hs[t], Wt, out=pre)
        torch.sigmoid(pre, out=Ss[t])
        i, f, g, o = i_s[t], f_s[t], tanh(pre_g, out=g_s[t]), o_s[t]
        if keep is None:
            c = torch.mul(f, cs[t], out=cs[t + 1]).addcmul_(i, g)  # c' = σ(f) c + σ(i) tanh(g)
            torch.mul(o, tanh(c, out=tcs[t]), out=hs[t + 1])  # h' = σ(o) tanh(c')
        else:
            c = torch.mul(f, cs[t]).addcmul_(i, g)
            h = torch.mul(o, tanh(c, out=tcs[t]))
            k = keep[:, t:t + 1]
            torch.where(k, c, cs[t], out=cs[t + 1])
            torch.where(k, h, hs[t], out=hs[t + 1])
    return {"Hp": Hp, "hT": hT, "Cs": Cs, "S": S, "TC": TC}


def gru_forward(X, W, b, state, keep):
    """Hs (n, T+1, H); U (n, T, 3H) = h_{t-1} W_hhᵀ + b_hh; RZ (n, T, 2H) = σ(r), σ(z);
    M (n, T, H) = m_t, the candidate state."""
    (h0,) = state
    n, T, G = X.shape
    H = G // 3
    Hs, U = X.new_empty(n, T + 1, H), X.new_empty(n, T, G)
    RZ, M = X.new_empty(n, T, 2 * H), X.new_empty(n, T, H)
    Hs[:, 0] = h0
    hs, Us, RZs, Ms, Wt = steps(Hs), steps(U), steps(RZ), steps(M), W.t()
    (X_rz, X_n), (U_rz, U_n), (r_s, z_s) = steps(X, 2 * H, H), steps(U, 2 * H, H), steps(RZ, H, H)
    for t in range(T):
        if b is None:
            torch.mm(hs[t], Wt, out=Us[t])
        else:
            torch.addmm(b, hs[t], Wt, out=Us[t])  # u = h W_hhᵀ + b_hh
        torch.add(X_rz[t], U_rz[t], out=RZs[t]).sigmoid_()  # σ(r), σ(z)
        m = tanh(torch.addcmul(X_n[t], r_s[t], U_n[t], out=Ms[t]), out=Ms[t])
        if keep is None:
            torch.lerp(m, hs[t], z_s[t], out=hs[t + 1])  # (1 - z) m + z h
        else:
            torch.where(keep[:, t:t + 1], torch.lerp(m, hs[t], z_s[t]), hs[t], out=hs[t + 1])
    return {"Hs": Hs, "U": U, "RZ": RZ, "M": M}


FORWARDS = {
    "RNN_TANH": lambda X, W, b, state, keep: rnn_forward(X, W, b, state, keep, relu=False),
    "RNN_RELU": lambda X, W, b, state, keep: rnn_forward(X, W, b, state, keep, relu=True),
    "LSTM": lstm_forward,
    "GRU": gru_forward,
}


__all__ = [
    "FAST_TANH_MIN", "FORWARDS", "gru_forward", "lstm_forward", "rnn_forward", "steps", "tanh",
]
