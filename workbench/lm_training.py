"""Moved to ``workbench.lm.training`` (this path is deprecated and kept for one release)."""

import sys

from workbench.deprecation import warn_renamed
from workbench.lm import training as _moved

warn_renamed("workbench.lm_training", "workbench.lm.training", "import", stacklevel=2)
sys.modules[__name__] = _moved  # the same module object: patches and isinstance agree
