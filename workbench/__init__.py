"""DP-SGD Workbench: transparent, tested reference implementations of DP-SGD in PyTorch.

The public API is a contract (ARCHITECTURE.md maps the code)::

    import workbench as wb
    grads = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")

Subpackages (part of the API, listed in ``__all__``): ``per_sample`` (per-sample gradients),
``clipping`` (norms and clipped sums: ghost clipping, book-keeping), ``layers`` (DP recurrent
and attention layers), ``accounting`` (RDP, PLD and PRV privacy accounting), ``dpsgd`` (the
private training loop), ``data`` (bundled data sets), ``models`` (benchmark model zoo), ``lm``
(the language-model chapter), ``methods`` (the one table of per-sample methods), ``audit``,
``bench`` (benchmarks), ``viz`` / ``widgets`` (plots and interactive explorers). Helper modules
(``checks``, ``errors``, ``validate``, ...) are imported, not listed: ``dir(wb)`` shows
``__all__`` only (``tests/test_public_names.py`` holds the list).

``import workbench`` loads torch and the training path only; ``audit``, ``bench``, ``viz`` and
``widgets`` (and pandas, scipy, matplotlib, ipywidgets) load on first use, e.g. the first
``wb.audit`` (``python -m workbench.bench imports`` measures the import).
"""

import importlib

from workbench import accounting, clipping, data, dpsgd, layers, lm, methods, models, per_sample
from workbench.clipping import (
    clipped_grad_sum,
    ghost_routes,
    per_sample_grad_norms,
    register_norm_sampler,
)
from workbench.dpsgd import PrivacyEngine, train
from workbench.errors import (
    LoopError,
    LossCouplingError,
    LossShapeError,
    NonFiniteGradientError,
    PerSampleCheckError,
    RecordCountError,
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
    # the subpackages
    "accounting", "audit", "bench", "clipping", "data", "dpsgd", "layers", "lm", "methods",
    "models", "per_sample", "viz", "widgets",
    # the functional API, the engine and the model checks
    "GRAD_SAMPLERS", "METHODS", "PrivacyEngine", "clipped_grad_sum", "fix_model", "ghost_routes",
    "per_sample_grad_norms", "per_sample_gradients", "register_grad_sampler",
    "register_norm_sampler", "train", "validate_model",
    # the errors
    "LoopError", "LossCouplingError", "LossShapeError", "NonFiniteGradientError",
    "PerSampleCheckError", "RecordCountError", "SampleMixingError", "UnattributedGradientError",
    "UnsupportedLayerError", "WorkbenchError",
]


def __dir__():
    """The API (``__all__``), not every helper module that importing it loaded."""
    return sorted(__all__)
