"""PrivacyEngine: make an ordinary PyTorch training loop differentially private.

Two lines change in a training script (the Opacus design; Yousefpour et al. 2021, arXiv
2109.12298, §2)::

    engine = wb.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
        data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0)

and the loop itself stays as it was. ``make_private`` returns, in every mode, the same three
things: the model (the same object, with recording hooks), a ``DPOptimizer`` and a Poisson
``DPDataLoader`` (q = batch_size / N). Every logical step is recorded by the accountant
(``accounting``), so ``engine.get_epsilon(delta)`` is the ε spent so far.
``make_private_with_epsilon`` first solves the σ that spends ``target_epsilon`` in ``epochs``.

Notation: N data set size, q sample rate, σ noise multiplier, C max_grad_norm.
"""


import torch.distributed as dist
from torch.utils.data import Subset

from workbench.accounting import PLDAccountant, RDPAccountant, get_noise_multiplier
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.dpsgd.sampling import DPDataLoader
from workbench.dpsgd.secure import SecureGenerator
from workbench.errors import SampleMixingError
from workbench.validate import validate_model

ACCOUNTANTS = {"rdp": RDPAccountant, "pld": PLDAccountant}


class VirtualStepLoader:
    """Splits each logical batch into chunks of at most ``max_physical_batch_size`` and
    tells the optimizer which chunk ends the logical batch (noise is added once, there)."""

    def __init__(self, loader, optimizer: DPOptimizer, max_physical_batch_size: int):
        if int(max_physical_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be a positive integer; got "
                             f"{max_physical_batch_size!r}")
        self.loader, self.optimizer = loader, optimizer
        self.size = int(max_physical_batch_size)
        self.sample_rate = getattr(loader, "sample_rate", None)
        self.dataset = loader.dataset

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            tensors = batch if isinstance(batch, (tuple, list)) else (batch,)
            n = tensors[0].shape[0]
            starts = list(range(0, n, self.size)) or [0]  # an empty batch: one empty chunk
            for k, start in enumerate(starts):
                chunk = type(tensors)(t[start:start + self.size] for t in tensors)
                self.optimizer.expect_more = k < len(starts) - 1
                yield chunk if isinstance(batch, (tuple, list)) else chunk[0]
            self.optimizer.expect_more = False


class PrivacyEngine:
    """Makes (model, optimizer, data loader) private and keeps the privacy ledger."""

    def __init__(self, accountant: str = "rdp", secure_mode: bool = False):
        self.secure_mode = bool(secure_mode)  # see secure.py for what it does and does not do
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {sorted(ACCOUNTANTS)}; "
                             f"got {accountant!r}")
        self.accountant_name = accountant
        self.accountant = ACCOUNTANTS[accountant]()
        self.sample_rate = None

    def make_private(self, *, module, optimizer, data_loader, noise_multiplier, max_grad_norm,
                     grad_sample_mode="einsum", poisson_sampling=True, loss_reduction="mean",
                     noise_generator=None, sampling_generator=None,
                     max_physical_batch_size=None):
        """(model, DPOptimizer, loader): the same shapes in every ``grad_sample_mode``."""
        if self.secure_mode:
            if noise_generator is not None or sampling_generator is not None:
                raise ValueError("secure_mode=True draws every noise sample and batch from the "
                                 "OS's cryptographic generator; do not pass noise_generator or "
                                 "sampling_generator (or use secure_mode=False to seed a run)")
            noise_generator = sampling_generator = SecureGenerator()
        blocking = [p for p in validate_model(module) if p.blocking]
        if blocking:
            raise SampleMixingError("the model cannot get per-sample gradients:\n  "
                                    + "\n  ".join(map(str, blocking))
                                    + "\nuse model = wb.fix_model(model) first")
        if poisson_sampling and dist.is_available() and dist.is_initialized():
            # each rank Poisson-samples its own shard with the same q: together, one Poisson
            # sample of the whole data set (batch_size = the expected *global* batch)
            rank, world, N = dist.get_rank(), dist.get_world_size(), len(data_loader.dataset)
            q = min(1.0, data_loader.batch_size / N)
            shard = Subset(data_loader.dataset, range(rank, N, world))
            loader = DPDataLoader(shard, sample_rate=q, steps=max(1, round(1 / q)),
                                  generator=sampling_generator)
        elif poisson_sampling:
            loader = DPDataLoader.from_data_loader(data_loader, generator=sampling_generator)
            q = loader.sample_rate
        else:  # fixed-size batches: the accountant's Poisson assumption is then optimistic
            loader = data_loader
            q = data_loader.batch_size / len(data_loader.dataset)
        self.sample_rate = q
        dp_optimizer = DPOptimizer(
            optimizer, module, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            expected_batch_size=q * len(data_loader.dataset), grad_sample_mode=grad_sample_mode,
            loss_reduction=loss_reduction, generator=noise_generator,
            on_step=lambda sigma: self.accountant.step(noise_multiplier=sigma, sample_rate=q))
        if max_physical_batch_size is not None:
            loader = VirtualStepLoader(loader, dp_optimizer, max_physical_batch_size)
        return module, dp_optimizer, loader

    def make_private_with_epsilon(self, *, target_epsilon, target_delta, epochs, data_loader,
                                  **kwargs):
        """``make_private`` with the σ that spends ``target_epsilon`` over ``epochs``.

        Planned for the steps the Poisson loader will run: ``epochs`` x round(1 / q).
        """
        q = min(1.0, data_loader.batch_size / len(data_loader.dataset))
        steps = round(epochs * max(1, round(1 / q)))
        sigma = get_noise_multiplier(target_epsilon, target_delta, q, steps=steps,
                                     accountant=self.accountant_name)
        return self.make_private(data_loader=data_loader, noise_multiplier=sigma, **kwargs)

    def get_epsilon(self, delta: float) -> float:
        """ε(δ) spent by every step taken so far."""
        return self.accountant.get_epsilon(delta)


__all__ = ["PrivacyEngine", "VirtualStepLoader"]
