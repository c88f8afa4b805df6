"""Renamed names, kept working for one release: one warning style, one mechanism.

Every rename of a public keyword, attribute, method or module path keeps the old name for one
release. Using it emits a ``FutureWarning`` (shown to users by default, unlike
``DeprecationWarning``) that names the new spelling::

    {where}: {old} is renamed {new}; {old} will be removed in the next release

The test suite turns exactly these warnings into errors (pyproject's ``filterwarnings``), so no
test or notebook of the workbench uses an old name by accident.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     keyword("einsum", {"grad_sample_mode": "vmap"}, "method", "grad_sample_mode", "f")
Traceback (most recent call last):
    ...
TypeError: f() got both method= and grad_sample_mode= (its old name); pass only method=
"""

import warnings

__all__ = ["Default", "keyword", "warn_renamed"]


def warn_renamed(old: str, new: str, where: str, stacklevel: int = 3) -> None:
    """The one deprecation warning: ``old`` (used) is now ``new``."""
    warnings.warn(f"{where}: {old} is renamed {new}; {old} will be removed in the next release",
                  FutureWarning, stacklevel=stacklevel)


class Default(str):
    """A keyword's string default, told apart from the same value passed explicitly
    (``value is DEFAULT``), so passing both a keyword and its old name is caught."""


def keyword(value, extra: dict, new: str, old: str, where: str):
    """The value of keyword ``new`` given ``value`` and the catch-all ``extra`` (``**kw``) that
    may hold its old name ``old``: warns when ``old`` is used, raises TypeError when both are
    given or when ``extra`` holds any other name (as Python would for an unknown keyword)."""
    extra = dict(extra)
    unknown = sorted(set(extra) - {old})
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if old not in extra:
        return str(value) if isinstance(value, Default) else value
    if not isinstance(value, Default):
        raise TypeError(f"{where}() got both {new}= and {old}= (its old name); pass only {new}=")
    warn_renamed(f"{old}=", f"{new}=", where, stacklevel=4)
    return extra[old]
