"""Exceptions the workbench raises, each one a user can act on.

Every message names the argument or module path, the value received and the fix.
They subclass the built-in exception a caller would expect (ValueError, TypeError), so
``except ValueError`` keeps working.
"""


class WorkbenchError(Exception):
    """Base class of every exception raised on purpose by the workbench."""


class SampleMixingError(WorkbenchError, ValueError):
    """A layer mixes the samples of a batch (e.g. BatchNorm): no per-sample gradients."""


class UnsupportedLayerError(WorkbenchError, NotImplementedError):
    """A layer (or one of its options) has no per-sample gradient sampler."""


class LossShapeError(WorkbenchError, ValueError):
    """``loss_fn`` did not return one loss per sample (a Tensor of shape (n,))."""


class PerSampleCheckError(WorkbenchError, RuntimeError):
    """A fast per-sample result failed its self-check against an exact twin: never returned."""


class NonFiniteGradientError(WorkbenchError, ValueError):
    """A record's per-sample gradient holds NaN or inf where no clipped sum can be made of it."""
