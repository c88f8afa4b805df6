"""One time step of the RNN, GRU and LSTM cells, written as PyTorch documents them.

A step function takes the step's input projection X_t = x_t W_ihᵀ + b (computed for all
steps at once by ``parts.InputProjection``), a function ``project(h, add=None)`` giving
h W_hhᵀ (+ b_hh) (+ add), the only matrix product left inside the loop (the
``RecurrentProjection`` part, or its replayed stand-in, see recurrence.py), and the state; it
returns the new state. Gate order and biases follow the ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``
documentation, so the weights of a torch.nn layer plug in unchanged.

Notation: x_t input, h hidden state, c cell state, σ the logistic sigmoid, ⊙ the elementwise
product, H hidden size.

    RNN    h' = tanh(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh)            (or relu)
    LSTM   [i, f, g, o] = x W_ihᵀ + b_ih + h W_hhᵀ + b_hh          4 blocks of H
           c' = σ(f) ⊙ c + σ(i) ⊙ tanh(g),    h' = σ(o) ⊙ tanh(c')
    GRU    [r, z] = σ(x W_ir,zᵀ + b_ir,z + h W_hr,zᵀ + b_hr,z)
           m = tanh(x W_inᵀ + b_in + r ⊙ (h W_hnᵀ + b_hn))
           h' = (1 - z) ⊙ m + z ⊙ h

Where the torch.nn documentation writes two biases, RNN and LSTM only ever use their sum, so
``InputProjection`` adds both; GRU's b_hn sits inside r ⊙ (...), so it stays with W_hh.
A state is a tuple: (h,) for RNN and GRU, (h, c) for LSTM.
"""

import torch


def rnn_tanh_step(X_t, project, state):
    (h,) = state
    return (torch.tanh(project(h, X_t)),)  # (n, H)


def rnn_relu_step(X_t, project, state):
    (h,) = state
    return (torch.relu(project(h, X_t)),)  # (n, H)


def lstm_step(X_t, project, state):
    h, c = state
    i, f, g, o = project(h, X_t).chunk(4, dim=1)  # gate pre-activations, (n, H) each
    c = torch.addcmul(torch.sigmoid(f) * c, torch.sigmoid(i), torch.tanh(g))
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def gru_step(X_t, project, state):
    (h,) = state
    H = h.shape[1]
    x_rz, x_n = X_t.split([2 * H, H], dim=1)
    u_rz, u_n = project(h).split([2 * H, H], dim=1)  # h W_hhᵀ + b_hh
    r, z = torch.sigmoid(x_rz + u_rz).chunk(2, dim=1)
    m = torch.tanh(torch.addcmul(x_n, r, u_n))  # x W_inᵀ + b_in + r ⊙ (h W_hnᵀ + b_hn)
    return (torch.lerp(m, h, z),)  # (1 - z) ⊙ m + z ⊙ h


STEPS = {
    "RNN_TANH": (rnn_tanh_step, 1),
    "RNN_RELU": (rnn_relu_step, 1),
    "LSTM": (lstm_step, 4),
    "GRU": (gru_step, 3),
}
"""mode (as torch.nn's ``RNNBase.mode``) -> (step function, number of gate blocks G)."""


__all__ = ["STEPS", "gru_step", "lstm_step", "rnn_relu_step", "rnn_tanh_step"]
