"""Importing the optional libraries of the real-architecture table (``pip install .[realmodels]``).

torchvision's C++ ops (nms, roi_align, ...) come compiled against one torch build. Where
torchvision's wheel was built for another build than the installed torch (PyPI's torchvision
is linked against CUDA torch; PyTorch's CPU index serves ``torch==2.13.0+cpu`` and the matching
``torchvision==0.28.0+cpu``), loading them fails, and torchvision 0.28 then fails at import
(``RuntimeError: operator torchvision::nms does not exist``): its ``_meta_registrations``
registers shapes for ops that were never loaded. timm and transformers import torchvision,
so they fail too.

The right install is torch and torchvision from the same index (the Makefile installs both
from ``TORCH_INDEX``). Where that is not what is installed, ``import_torchvision`` imports
torchvision's Python parts without those registrations: the models (convolutions, norms,
pooling) never call the C++ ops, and calling one raises torchvision's own "Couldn't load
custom C++ ops" error. It says so once, with a warning.
"""

import importlib
import os
import sys
import types
import warnings


def import_torchvision():
    """``torchvision``, with its Python parts only where its C++ ops cannot load."""
    try:
        return importlib.import_module("torchvision")
    except ModuleNotFoundError:
        raise
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        reason = str(error)
    for name in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    sys.modules["torchvision._meta_registrations"] = types.ModuleType(
        "torchvision._meta_registrations")  # shapes of ops that were never loaded: skipped
    module = importlib.import_module("torchvision")
    warnings.warn(f"torchvision {module.__version__} cannot load its C++ ops beside torch "
                  f"(its wheel was built for another torch build: {reason}); its models work, "
                  f"its ops (nms, roi_align) do not. Install torch and torchvision from the "
                  f"same index (make test does) to have both", stacklevel=2)
    return module


def import_transformers():
    """``transformers``, which imports torchvision where it is installed. The table builds
    every model from a config with random weights, so the hub is never needed: offline mode is
    set unless the caller chose otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import_torchvision()
    except ModuleNotFoundError:
        pass  # transformers' text models do not need it
    return importlib.import_module("transformers")


def import_timm():
    """``timm`` (after ``import_torchvision``, which timm imports)."""
    import_torchvision()
    return importlib.import_module("timm")


__all__ = ["import_timm", "import_torchvision", "import_transformers"]
