"""The RDP accountant: Rényi DP of the sampled Gaussian mechanism, summed over steps.

Mironov, Talwar, Zhang (2019), arXiv:1908.10530, give ε_g(α) of one step (``../rdp.py``); RDP
adds up over steps (Mironov 2017, arXiv:1702.07476, Prop. 1),

    ε(α) = Σ_g T_g ε_g(α),

and the conversion of Balle et al. (2020), arXiv:1905.09982, Thm. 21, turns it into (ε, δ),
minimised over the orders α (``../convert.py``). Fast (about a millisecond), and a curve over
steps is almost free since ε(α) is linear in T.

Notation: σ noise multiplier, q sample rate, T steps, α order, δ target delta.
"""

import numpy as np

from workbench.accounting.accountant import Accountant
from workbench.accounting.convert import rdp_to_epsilon
from workbench.accounting.noise_range import accounted_history
from workbench.accounting.rdp import DEFAULT_ORDERS, rdp_one_step
from workbench.accounting.registry import register_accountant
from workbench.checks import check_delta, check_orders
from workbench.deprecation import warn_renamed


def rdp_epsilon(history, delta, orders=DEFAULT_ORDERS):
    """ε(δ) after the groups [(σ, q, T), ...] (all > 0): Σ_g T_g ε_g(α), converted."""
    orders = check_orders(orders)
    rdp = sum(t * rdp_one_step(q, s, orders) for s, q, t in history)  # (orders,)
    return rdp_to_epsilon(orders, rdp, delta)[0]


def rdp_curve(q, sigma, steps, delta, orders=DEFAULT_ORDERS):
    """ε(δ) after each count in ``steps`` (all > 0): one ε(α), scaled by each T."""
    orders = check_orders(orders)
    rdp = np.outer(steps, rdp_one_step(q, sigma, orders))  # (n, orders)
    return rdp_to_epsilon(orders, rdp, delta)[0]


class RDPAccountant(Accountant):
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

    name = "rdp"

    def __init__(self, orders=DEFAULT_ORDERS):
        super().__init__()
        self.orders = check_orders(orders)

    def get_privacy_spent(self, delta):
        """The old name of ``get_epsilon_and_order`` (deprecated)."""
        warn_renamed("RDPAccountant.get_privacy_spent", "get_epsilon_and_order", "RDPAccountant")
        return self.get_epsilon_and_order(delta)

    def get_epsilon_and_order(self, delta):
        """(ε, best order α) for ``delta``; (0.0, None) while no record has been sampled.

        The same ε as ``get_epsilon``. Before the first step (or with only q = 0 or T = 0
        steps) nothing was released, ε = 0 and no order is used; converting an RDP of 0 would
        instead give the conversion's floor, a positive ε for nothing spent.
        """
        delta = check_delta(delta)
        live = [(s, q, t) for s, q, t in accounted_history(self.history) if q > 0 and t > 0]
        if not live:  # the groups ``get_epsilon`` counts (curve.history_epsilon): a group of
            return 0.0, None  # no steps or no sampling adds nothing (0 x inf was a NaN)
        if any(s == 0 for s, _, _ in live):
            return float("inf"), None
        rdp = np.zeros_like(self.orders)
        for sigma, q, t in live:
            rdp += t * rdp_one_step(q, sigma, self.orders)  # RDP adds up over steps
        return rdp_to_epsilon(self.orders, rdp, delta)

    def _options(self):
        return {"orders": [float(a) for a in self.orders]}

    def _load_options(self, state_dict):
        self.orders = check_orders(state_dict["orders"])


register_accountant("rdp", label="RDP", epsilon=rdp_epsilon, curve=rdp_curve,
                    accountant_class=RDPAccountant, style={"color": "C0"})


__all__ = ["RDPAccountant", "rdp_curve", "rdp_epsilon"]
