"""The real-architecture table on the command line: ``python -m workbench audit --model``.

``--model``, ``--data`` and ``--loss`` take ``module:callable``; this module has three
callables per model of ``PROBLEMS`` (tiny config, random weights, float64, nothing downloaded):

    <name>()          the model                       (``Problem.build``)
    <name>_batch()    (inputs, targets), n = T = 5     (``Problem.batch``)
    <name>_loss       its per-sample loss (n,)         (next-token or label cross-entropy)

so, for example,

    python -m workbench audit --model workbench.realzoo.cli:timm_convnext \\
        --data workbench.realzoo.cli:timm_convnext_batch \\
        --loss workbench.realzoo.cli:timm_convnext_loss

audits the per-sample gradients (and the rest of the suite) on timm's ConvNeXt.
"""

from workbench.realzoo import PROBLEMS

SUFFIXES = ("_batch", "_loss")


def _lookup(attr: str):
    """(problem, suffix) for ``<name>``, ``<name>_batch`` or ``<name>_loss``, or None."""
    if attr in PROBLEMS:
        return PROBLEMS[attr], ""
    for suffix in SUFFIXES:
        if attr.endswith(suffix) and attr.removesuffix(suffix) in PROBLEMS:
            return PROBLEMS[attr.removesuffix(suffix)], suffix
    return None


def __getattr__(attr: str):
    found = _lookup(attr)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}; models: "
                             f"{', '.join(PROBLEMS)} (each also as <name>_batch, <name>_loss)")
    problem, suffix = found
    if suffix == "_loss":
        return problem.loss_fn
    if suffix == "_batch":
        return lambda: problem.batch(5, T=5)
    return lambda: problem.build()


def __dir__():
    return sorted([*PROBLEMS, *(name + s for name in PROBLEMS for s in SUFFIXES), "SUFFIXES"])


__all__ = ["SUFFIXES"]
