"""Stateful accountants: a history of DP-SGD steps, and ε on demand.

The thin wrapper over the pure functions of ``curve.py`` (DESIGN.md, style item 6): the class
only records what was run, as groups (σ, q, T) with consecutive steps of equal σ and q merged,
so a training loop can call ``.step()`` after every optimiser step and a schedule that changes σ
or q (heterogeneous composition) is kept exactly. ε is recomputed from the history when asked.

    RDPAccountant: Rényi DP, Mironov, Talwar, Zhang (2019), arXiv:1908.10530, with the
                   conversion of Balle et al. (2020), arXiv:1905.09982, Thm. 21.
    PLDAccountant: privacy-loss distribution composed by FFT, Koskela et al. (2020),
                   arXiv:1906.03049, discretised as in Doroshenko et al. (2022), arXiv:2207.04380.

ε is recomputed from the (short, merged) history on every ``get_epsilon``: about a millisecond
for RDP, tens to hundreds of milliseconds for PLD, so call it once per epoch, not per step.

``state_dict()`` holds only lists, floats, ints and strings, so it can be saved inside a training
checkpoint and read back with ``torch.load(..., weights_only=True)``.

Notation: σ noise multiplier, q sample rate, T steps, δ target delta.
"""

import numpy as np

from workbench.accounting.convert import rdp_to_epsilon
from workbench.accounting.curve import PLD_DISCRETIZATION, check_history, history_epsilon
from workbench.accounting.rdp import DEFAULT_ORDERS, rdp_one_step
from workbench.checks import (
    check_delta,
    check_noise_multiplier,
    check_orders,
    check_positive,
    check_sample_rate,
    check_steps,
)


class _Accountant:
    """History of (σ, q, T) groups; subclasses say how to turn it into ε."""

    mechanism = ""

    def __init__(self):
        self.history = []  # [(σ, q, T), ...], consecutive equal (σ, q) merged

    def step(self, *, noise_multiplier, sample_rate, steps=1):
        """Record ``steps`` steps with noise multiplier σ and sample rate q."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        steps = check_steps(steps)
        if steps == 0:
            return
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + steps)
        else:
            self.history.append((sigma, q, steps))

    def __len__(self):
        return sum(t for _, _, t in self.history)

    def __repr__(self):
        return f"{type(self).__name__}(steps={len(self)}, groups={len(self.history)})"

    def get_epsilon(self, delta):
        return history_epsilon(self.history, delta, self.mechanism, **self._options())

    def _options(self):
        """The accountant's options as plain Python values (also saved in the state)."""
        return {}

    def state_dict(self):
        """Plain Python state: {"mechanism", "history": [[σ, q, T], ...], options...}."""
        return {"mechanism": self.mechanism, "history": [list(g) for g in self.history],
                **self._options()}

    def load_state_dict(self, state_dict):
        """Restore the history (and options) saved by ``state_dict()``; every key is required."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from state_dict(); got "
                            f"{type(state_dict).__name__}")
        if state_dict.get("mechanism", self.mechanism) != self.mechanism:
            raise ValueError(f"state_dict is from a {state_dict.get('mechanism')!r} accountant; "
                             f"this one is {self.mechanism!r}")
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise KeyError(f"state_dict for a {self.mechanism!r} accountant: missing keys "
                           f"{missing}, unexpected keys {unexpected}; pass the dict that "
                           f"{type(self).__name__}.state_dict() returned")
        self.history = check_history(state_dict["history"])
        self._load_options(state_dict)

    def _load_options(self, state_dict):
        pass


class RDPAccountant(_Accountant):
    """Rényi DP accountant; ``orders`` are the α tried (default ``DEFAULT_ORDERS``).

    >>> acc = RDPAccountant()
    >>> for _ in range(100):
    ...     acc.step(noise_multiplier=1.0, sample_rate=0.01)
    >>> acc.step(noise_multiplier=0.8, sample_rate=0.02, steps=50)
    >>> len(acc), acc.history
    (150, [(1.0, 0.01, 100), (0.8, 0.02, 50)])
    >>> round(acc.get_epsilon(1e-5), 3)
    2.897
    """

    mechanism = "rdp"

    def __init__(self, orders=DEFAULT_ORDERS):
        super().__init__()
        self.orders = check_orders(orders)

    def get_privacy_spent(self, delta):
        """(ε, best order α) for ``delta``; (0.0, None) while no record has been sampled.

        The same ε as ``get_epsilon``. Before the first step (or with only q = 0 or T = 0
        steps) nothing was released, ε = 0 and no order is used; converting an RDP of 0 would
        instead give the conversion's floor, a positive ε for nothing spent.
        """
        delta = check_delta(delta)
        if not any(q > 0 and t > 0 for _, q, t in self.history):
            return 0.0, None
        rdp = np.zeros_like(self.orders)
        for sigma, q, t in self.history:
            rdp += t * rdp_one_step(q, sigma, self.orders)  # RDP adds up over steps
        return rdp_to_epsilon(self.orders, rdp, delta)

    def _options(self):
        return {"orders": [float(a) for a in self.orders]}

    def _load_options(self, state_dict):
        self.orders = check_orders(state_dict["orders"])


class PLDAccountant(_Accountant):
    """Privacy-loss-distribution accountant; ``discretization`` is the loss grid step h.

    >>> acc = PLDAccountant()
    >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=1000)
    >>> round(acc.get_epsilon(1e-5), 3)
    1.828
    """

    mechanism = "pld"

    def __init__(self, discretization=PLD_DISCRETIZATION):
        super().__init__()
        self.discretization = check_positive(discretization, "discretization")

    def _options(self):
        return {"discretization": self.discretization}

    def _load_options(self, state_dict):
        self.discretization = check_positive(state_dict["discretization"], "discretization")
