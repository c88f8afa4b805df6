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


class LossCouplingError(WorkbenchError, ValueError):
    """The loss makes one record's gradient depend on other records (or cannot be attributed
    to records): DP-SGD's per-record clipping would not bound the sensitivity."""


class UnattributedGradientError(WorkbenchError, ValueError):
    """Part of the loop's gradient reaches the parameters outside the model's output (an L2
    penalty, a loss reading a parameter): it cannot be attributed to records and clipped."""


class NonFiniteGradientError(WorkbenchError, ValueError):
    """A record's per-sample gradient holds NaN or inf where no clipped sum can be made of it."""


class NonFiniteStepError(WorkbenchError, ValueError):
    """A step under audit returned NaN or inf: no audit of it can mean anything."""


class LoopError(WorkbenchError, RuntimeError):
    """The training loop's calls are not what the DP optimizer needs (a step without a fresh
    backward pass into the model made private, a model changed after make_private, a step
    in the middle of a logical batch): nothing is released."""


class RecordCountError(WorkbenchError, RuntimeError):
    """The rows one step clipped are not the records the private loader sampled for it (a
    batch forwarded twice, a record's views concatenated, two loader batches in one step):
    a record would count more than once, its influence above C."""


class CalibrationError(WorkbenchError, ValueError):
    """Noise calibration cannot return the σ its contract promises (ε within the relative
    tolerance below the target, never above): the accountant refused on the way, cannot
    reach the target, or cannot compute the noise that would spend it."""


__all__ = [
    "CalibrationError", "LoopError", "LossCouplingError", "LossShapeError",
    "NonFiniteGradientError", "NonFiniteStepError", "PerSampleCheckError", "RecordCountError",
    "SampleMixingError", "UnattributedGradientError", "UnsupportedLayerError", "WorkbenchError",
]
