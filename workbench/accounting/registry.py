"""One table naming the accountants, one naming the batch samplers.

An *accountant* registers itself, once, in the file that implements it
(``accountants/<name>.py``; every file there is imported, ``workbench.plugins``)::

    register_accountant("rdp", label="RDP", epsilon=rdp_epsilon, curve=rdp_curve,
                        accountant_class=RDPAccountant)

- ``epsilon(history, delta, **options) -> float``: ε(δ) after the groups [(σ, q, T), ...] of a
  run. The caller (``curve.history_epsilon``) has validated them and removed the empty ones,
  and answers the trivial runs itself (no group left: 0; some σ = 0: inf), so every group
  has σ > 0, q > 0, T > 0;
- ``curve(q, σ, steps, delta, **options) -> array`` (optional): ε after each count in
  ``steps`` (all > 0) at once, when that is cheaper than one ``epsilon`` per point;
- options: the keyword arguments those functions name (RDP: ``orders``; PLD:
  ``discretization``, ``max_refine``, ``max_grid_points``). Every caller passes an accountant
  only the options its function names (``options_for``), so one call site can carry both;
- ``accountant_class`` (optional): the stateful class (``accountant.Accountant`` subclass);
  without one, ``accountant.make_accountant`` makes a plain history-keeping ``Accountant``
  named after it (made there, not here: this table imports no accountant, so the
  accountants, the ε functions of ``curve.py`` and this table form no import cycle);
- ``never_above``: names of accountants whose ε this one never exceeds (PLD: RDP). The audit
  report checks it, and the noise calibration starts from their σ (an upper end);
- for the budget explorer: ``slow`` (drawn at fewer points and capped by the fast curves: the
  smaller of two upper bounds is one too), ``style`` (line keywords), ``explore_label(options)``
  (the legend, given the options the explorer passed, e.g. PLD's coarse ``discretization``).

The training engine, ``get_noise_multiplier``, the ε functions, the budget explorer and the audit
report read this table instead of spelling the names out. (The batch samplers' table,
``SAMPLERS``, is in ``bounds.py`` beside the bounds it names.)

>>> sorted(ACCOUNTANTS), ACCOUNTANTS["pld"].label, ACCOUNTANTS["pld"].never_above
(['pld', 'prv', 'rdp'], 'PLD', ('rdp',))
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from workbench.checks import check_choice


@dataclass(frozen=True)
class AccountantSpec:
    """One accountant's entry in ``ACCOUNTANTS`` (see the module docstring for each field)."""

    name: str
    label: str
    epsilon: Callable
    curve: Callable | None = None
    accountant_class: type | None = None
    never_above: tuple = ()
    slow: bool = False
    style: dict = field(default_factory=dict)
    explore_label: Callable | None = None

    def options_for(self, fn, options):
        """The entries of ``options`` that ``fn`` (this accountant's function) names."""
        accepted = _keywords(fn)
        return dict(options) if accepted is None else {
            k: v for k, v in options.items() if k in accepted}


@lru_cache(maxsize=None)
def _keywords(fn):
    """The parameter names of ``fn``, or None when it takes **kwargs (every option)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


ACCOUNTANTS: dict[str, AccountantSpec] = {}
"""name -> AccountantSpec: the fast ones first, each group in registration order (RDP, PLD).
Every listing (explorer curves and legend, report columns) follows this order."""


def register_accountant(name, *, label, epsilon, curve=None, accountant_class=None,
                        never_above=(), slow=False, style=None, explore_label=None):
    """Add an accountant to ``ACCOUNTANTS``; returns its ``AccountantSpec``.

    A name already taken raises (two files claiming one name would silently shadow each
    other); ``unregister_accountant`` first to replace one.
    """
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
        raise ValueError(f"register_accountant: name must be a lower-case identifier such as "
                         f"'rdp'; got {name!r}")
    if name in ACCOUNTANTS:
        raise ValueError(f"register_accountant: an accountant named {name!r} is already "
                         f"registered; unregister_accountant({name!r}) first to replace it")
    for fn_name, fn in (("epsilon", epsilon), ("curve", curve), ("explore_label", explore_label)):
        if fn is not None and not callable(fn):
            raise TypeError(f"register_accountant({name!r}): {fn_name} must be callable; "
                            f"got {fn!r}")
    if accountant_class is not None and getattr(accountant_class, "name", None) != name:
        raise ValueError(f"register_accountant({name!r}): accountant_class.name must be "
                         f"{name!r}; got {getattr(accountant_class, 'name', None)!r}")
    spec = AccountantSpec(name, str(label), epsilon, curve, accountant_class,
                          tuple(never_above), bool(slow), dict(style or {}), explore_label)
    listed = sorted([*ACCOUNTANTS.values(), spec], key=lambda a: a.slow)  # stable: fast first
    ACCOUNTANTS.clear()  # in place: every module holds this one dict
    ACCOUNTANTS.update((a.name, a) for a in listed)
    return spec


def unregister_accountant(name):
    """Remove ``name`` from ``ACCOUNTANTS`` (tests, or to replace a built-in)."""
    return ACCOUNTANTS.pop(check_accountant(name))


def check_accountant(name):
    """``name`` is a registered accountant, else ValueError listing them."""
    return check_choice(name, "accountant", ACCOUNTANTS)


def get_accountant(name):
    """The ``AccountantSpec`` registered as ``name``."""
    return ACCOUNTANTS[check_accountant(name)]


__all__ = [
    "ACCOUNTANTS", "AccountantSpec", "check_accountant", "get_accountant", "register_accountant",
    "unregister_accountant",
]
