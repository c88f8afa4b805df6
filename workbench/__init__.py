"""DP-SGD Workbench: transparent, tested reference implementations of DP-SGD in PyTorch.

The public API is a contract (ARCHITECTURE.md maps the code)::

    import workbench as wb
    grads = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")

Submodules: ``per_sample`` (per-sample gradients), ``clipping`` (norms and clipped sums:
ghost clipping, book-keeping), ``layers`` (DP recurrent and attention layers),
``accounting`` (RDP and PLD privacy accounting), ``dpsgd`` (Poisson sampling), ``data``
(bundled data sets), ``models`` (benchmark model zoo), ``bench`` (benchmarks),
``viz`` / ``widgets`` (plots and interactive explorers).

``import workbench`` loads torch and the training path only; ``audit``, ``bench``, ``viz`` and
``widgets`` (and pandas, scipy, matplotlib, ipywidgets) load on first use, e.g. the first
``wb.audit`` (``python -m workbench.bench imports`` measures the import).
"""

import importlib

from workbench import accounting, data, layers, models
from workbench.clipping import (
    clipped_grad_sum,
    ghost_routes,
    per_sample_grad_norms,
    register_norm_sampler,
)
from workbench.dpsgd import PrivacyEngine, train
from workbench.errors import (
    LossCouplingError,
    LossShapeError,
    NonFiniteGradientError,
    PerSampleCheckError,
    SampleMixingError,
    UnattributedGradientError,
    UnsupportedLayerError,
    WorkbenchError,
)
from workbench.per_sample import (
    GRAD_SAMPLERS,
    METHODS,
    per_sample_gradients,
    register_grad_sampler,
)
from workbench.validate import fix_model, validate_model

__version__ = "0.1.0"

LAZY_SUBMODULES = ("audit", "bench", "viz", "widgets")


def __getattr__(name):
    """``wb.audit`` and the other heavy submodules, imported on first use."""
    if name in LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "GRAD_SAMPLERS",
    "METHODS",
    "PrivacyEngine",
    "LossCouplingError",
    "LossShapeError",
    "NonFiniteGradientError",
    "PerSampleCheckError",
    "SampleMixingError",
    "UnattributedGradientError",
    "UnsupportedLayerError",
    "WorkbenchError",
    "accounting",
    "clipped_grad_sum",
    "data",
    "fix_model",
    "ghost_routes",
    "layers",
    "models",
    "per_sample_grad_norms",
    "per_sample_gradients",
    "register_grad_sampler",
    "register_norm_sampler",
    "train",
    "validate_model",
]
