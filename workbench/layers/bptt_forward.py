"""The forward values of the DP recurrent layers' loop, and what bptt.py's backward needs.

``bptt.py`` runs the recurrence as one autograd node: its forward pass computes, without
autograd, the outputs and the tensors the hand-written backward reads (gate activations, cell
states). Two ways, same values:

- **the loop** (``FORWARDS``): one step at a time from the input projections X (n, T, G H),
  one matrix product and a few elementwise ops a step; handles masks (packed sequences);
- **torch's kernel** (``kernel_forward``): the states h_1..h_T from torch.nn's fused kernel
  (``torch._VF.lstm`` etc., the one ``nn.LSTM`` runs), then the gates recomputed for all T
  steps at once from H_prev = (h_0..h_{T-1}): one product, no per-step ops (LSTM's cell state
  is a cheap recurrence, c_t = σ(f_t) c_{t-1} + σ(i_t) tanh(g_t), one op a step). Used for
  unmasked input at small n H, where per-op overhead is the time.

The cell equations are cells.py's. Notation: n batch, T steps, H hidden size, G gate blocks,
h hidden state, c cell state, σ the logistic sigmoid.
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


def rnn_forward(X, W, b, state, keep, relu):
    """Hs (n, T+1, H) = [h_0, h_1, ..., h_T]."""
    (h0,) = state
    n, T, _ = X.shape
    Hs = X.new_empty(n, T + 1, h0.shape[1])
    Hs[:, 0] = h0
    hs, Wt = Hs.unbind(1), W.t()
    act = torch.relu_ if relu else (lambda v: tanh(v, out=v))
    for t, X_t in enumerate(X.unbind(1)):
        if keep is None:
            act(torch.addmm(X_t, hs[t], Wt, out=hs[t + 1]))  # φ(X_t + h W_hhᵀ)
        else:
            torch.where(keep[:, t:t + 1], act(torch.addmm(X_t, hs[t], Wt)), hs[t], out=hs[t + 1])
    return {"Hs": Hs}


def lstm_forward(X, W, b, state, keep):
    """Hs, Cs (n, T+1, H) with the initial states; S (n, T, 4H): σ(i), σ(f), tanh(g), σ(o);
    TC (n, T, H): tanh(c'_t) of the cell's new state (before a mask keeps the old one)."""
    h0, c0 = state
    n, T, G = X.shape
    H = G // 4
    Hs, Cs = X.new_empty(n, T + 1, H), X.new_empty(n, T + 1, H)
    S, TC = X.new_empty(n, T, G), X.new_empty(n, T, H)
    Hs[:, 0], Cs[:, 0] = h0, c0
    hs, cs, Ss, tcs, Wt = Hs.unbind(1), Cs.unbind(1), S.unbind(1), TC.unbind(1), W.t()
    for t, X_t in enumerate(X.unbind(1)):
        pre = torch.addmm(X_t, hs[t], Wt)  # (n, 4H) gate pre-activations
        s = torch.sigmoid(pre, out=Ss[t])
        i, f, g, o = s.chunk(4, dim=1)
        tanh(pre[:, 2 * H:3 * H], out=g)
        if keep is None:
            c = torch.mul(f, cs[t], out=cs[t + 1]).addcmul_(i, g)  # c' = σ(f) c + σ(i) tanh(g)
            torch.mul(o, tanh(c, out=tcs[t]), out=hs[t + 1])  # h' = σ(o) tanh(c')
        else:
            c = torch.mul(f, cs[t]).addcmul_(i, g)
            h = torch.mul(o, tanh(c, out=tcs[t]))
            k = keep[:, t:t + 1]
            torch.where(k, c, cs[t], out=cs[t + 1])
            torch.where(k, h, hs[t], out=hs[t + 1])
    return {"Hs": Hs, "Cs": Cs, "S": S, "TC": TC}


def gru_forward(X, W, b, state, keep):
    """Hs (n, T+1, H); U (n, T, 3H) = h_{t-1} W_hhᵀ + b_hh; RZ (n, T, 2H) = σ(r), σ(z);
    M (n, T, H) = m_t, the candidate state."""
    (h0,) = state
    n, T, G = X.shape
    H = G // 3
    Hs, U = X.new_empty(n, T + 1, H), X.new_empty(n, T, G)
    RZ, M = X.new_empty(n, T, 2 * H), X.new_empty(n, T, H)
    Hs[:, 0] = h0
    hs, Us, RZs, Ms, Wt = Hs.unbind(1), U.unbind(1), RZ.unbind(1), M.unbind(1), W.t()
    for t, X_t in enumerate(X.unbind(1)):
        u = torch.mm(hs[t], Wt, out=Us[t]) if b is None else torch.addmm(b, hs[t], Wt, out=Us[t])
        rz = torch.add(X_t[:, :2 * H], u[:, :2 * H], out=RZs[t]).sigmoid_()
        r, z = rz.chunk(2, dim=1)
        m = torch.addcmul(X_t[:, 2 * H:], r, u[:, 2 * H:], out=Ms[t])
        tanh(m, out=m)
        if keep is None:
            torch.lerp(m, hs[t], z, out=hs[t + 1])  # (1 - z) m + z h
        else:
            torch.where(keep[:, t:t + 1], torch.lerp(m, hs[t], z), hs[t], out=hs[t + 1])
    return {"Hs": Hs, "U": U, "RZ": RZ, "M": M}


# --- the same values from torch.nn's fused kernel (no masks) --------------------------------

KERNEL_MAX = 64 * 64
"""Use the kernel up to n H = KERNEL_MAX. It pays one more input projection (inside the
kernel) and one recomputed product, and saves ~7 small ops a step: a gain where per-op
overhead is the time (small n H), a loss where arithmetic is (measured on a 1-thread CPU:
DPLSTM/DPGRU with H = 64 gain at n = 16, break even at n = 64, lose at n = 256)."""

_KERNELS = {"RNN_TANH": torch._VF.rnn_tanh, "RNN_RELU": torch._VF.rnn_relu,
            "LSTM": torch._VF.lstm, "GRU": torch._VF.gru}


def kernel_forward(mode, x, X, weights, W, b, state):
    """``FORWARDS[mode]``'s result for unmasked input, the states from torch's kernel.

    x (n, T, d) the layer's input, X = ih(x); ``weights``: [W_ih, W_hh(, b_ih, b_hh)] in
    torch.nn's order; W, b: the recurrent weight and GRU's b_hh, as in ``FORWARDS``.
    """
    n, T, G = X.shape
    H = G // {"LSTM": 4, "GRU": 3}.get(mode, 1)
    hx = tuple(s.unsqueeze(0) for s in state) if mode == "LSTM" else state[0].unsqueeze(0)
    out = _KERNELS[mode](x, hx, weights, len(weights) == 4, 1, 0.0, False, False, True)[0]
    Hs = torch.cat([state[0].unsqueeze(1), out], dim=1)  # (n, T+1, H)
    if mode.startswith("RNN"):
        return {"Hs": Hs}
    H_prev = Hs[:, :T].reshape(n * T, H)
    if mode == "GRU":
        U = (torch.mm(H_prev, W.t()) if b is None else torch.addmm(b, H_prev, W.t())).view(n, T, G)
        RZ = torch.sigmoid(X[..., :2 * H] + U[..., :2 * H])
        M = tanh(torch.addcmul(X[..., 2 * H:], RZ[..., :H], U[..., 2 * H:]))
        return {"Hs": Hs, "U": U, "RZ": RZ, "M": M}
    S = torch.addmm(X.reshape(n * T, G), H_prev, W.t()).view(n, T, G)  # pre-activations
    i, f, g, o = S.chunk(4, dim=2)
    for block in (i, f, o):
        block.sigmoid_()
    tanh(g, out=g)
    Cs = X.new_empty(n, T + 1, H)
    Cs[:, 0] = state[1]
    torch.mul(i, g, out=Cs[:, 1:])  # σ(i) tanh(g), then + σ(f) c_{t-1} step by step
    cs, fs = Cs.unbind(1), f.unbind(1)
    for t in range(T):
        cs[t + 1].addcmul_(fs[t], cs[t])
    return {"Hs": Hs, "Cs": Cs, "S": S, "TC": tanh(Cs[:, 1:])}


FORWARDS = {
    "RNN_TANH": lambda X, W, b, state, keep: rnn_forward(X, W, b, state, keep, relu=False),
    "RNN_RELU": lambda X, W, b, state, keep: rnn_forward(X, W, b, state, keep, relu=True),
    "LSTM": lstm_forward,
    "GRU": gru_forward,
}
