"""Does re-seeding replay a step's random draws when the batch loses its last record?

``influence.py`` compares S(A) with S(A \\ {i}) with torch's RNG re-seeded identically before
both, record i last. The remaining records see the same random numbers only if every random
call starts from the same generator state at both batch sizes: true for one call (a single
Dropout's mask of n rows starts with the mask of n − 1 rows) or for calls whose consumption
does not depend on n, false as soon as a call *before* another consumes n-dependent amounts
(two Dropout layers: the second layer's masks start at another offset) or for a kernel that
draws per chunk (scaled-dot-product attention dropout, a CUDA generator's offsets).

``replays(released_sum, idx, seed)`` runs the step at n and at n − 1 records under a
``TorchFunctionMode`` that records the CPU generator state before each random call
(``RANDOM``, by name); the draws replay when both runs make the same calls from the same
states, and none is attention dropout or on a CUDA tensor (whose draws this cannot see).
"""

import torch
from torch.overrides import TorchFunctionMode

RANDOM = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
          "feature_alpha_dropout", "bernoulli", "bernoulli_", "rand", "randn", "rand_like",
          "randn_like", "randint", "randint_like", "randperm", "normal", "normal_", "uniform_",
          "exponential_", "random_", "multinomial", "rrelu", "rrelu_", "native_dropout",
          "scaled_dot_product_attention"}
UNSEEN = {"scaled_dot_product_attention"}  # fused kernels: draws per chunk, not per row


class RandomCalls(TorchFunctionMode):
    """(name, generator state before the call) of each random call; ``opaque``: a call whose
    draws the CPU state does not describe (attention dropout, a CUDA tensor)."""

    def __init__(self):
        super().__init__()
        self.calls, self.opaque = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in RANDOM:
            if name == "scaled_dot_product_attention":
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                if not p:
                    return func(*args, **kwargs)
            self.opaque |= name in UNSEEN or any(
                isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            self.calls.append((name, torch.get_rng_state()))
        return func(*args, **kwargs)


def _trace(released_sum, idx, seed) -> RandomCalls:
    with torch.random.fork_rng(devices=[]), RandomCalls() as calls:
        torch.manual_seed(seed)
        released_sum(torch.as_tensor(idx, dtype=torch.long))
    return calls


def replays(released_sum, idx, seed: int) -> bool:
    """True when the records idx[:-1] draw the same random numbers in the batch idx as in the
    batch idx[:-1] (module docstring)."""
    big, small = _trace(released_sum, idx, seed), _trace(released_sum, idx[:-1], seed)
    if big.opaque or small.opaque or len(big.calls) != len(small.calls):
        return False
    return all(a == b and torch.equal(s, t) for (a, s), (b, t) in zip(big.calls, small.calls))


__all__ = ["RANDOM", "UNSEEN", "RandomCalls", "replays"]
