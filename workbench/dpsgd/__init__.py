"""DP-SGD training: Poisson sampling (more to come: the DP optimizer and PrivacyEngine)."""

from workbench.dpsgd.sampling import DPDataLoader, PoissonBatchSampler

__all__ = ["DPDataLoader", "PoissonBatchSampler"]
