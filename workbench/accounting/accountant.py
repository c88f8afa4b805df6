"""Stateful accountants: a history of DP-SGD steps, and ε on demand.

The thin wrapper over the pure functions of ``curve.py`` (ARCHITECTURE.md, style item 6): the class
only records what was run, as groups (σ, q, T) with consecutive steps of equal σ and q merged,
so a training loop can call ``.step()`` after every optimiser step and a schedule that changes σ
or q (heterogeneous composition) is kept exactly. ε is recomputed from the history when asked,
by the accountant registered under ``name`` (``registry.py``). The subclasses with options
live beside their ε functions: ``accountants/rdp.py`` (RDPAccountant, Rényi DP) and
``accountants/pld.py`` (PLDAccountant, privacy-loss distribution); an accountant registered
without a class gets a plain ``Accountant`` subclass named after it.

ε is recomputed from the (short, merged) history on every ``get_epsilon``: about a millisecond
for RDP, tens to hundreds of milliseconds for PLD, so call it once per epoch, not per step.

``state_dict()`` holds only lists, floats, ints and strings, so it can be saved inside a training
checkpoint and read back with ``torch.load(..., weights_only=True)``.

Renamed (kept for one release, with a ``FutureWarning``: ``deprecation.py``): the class
attribute ``mechanism`` is ``name`` (it names the accountant, not the mechanism accounted);
``RDPAccountant.get_privacy_spent`` is ``get_epsilon_and_order``. A state saved with the old
``"mechanism"`` key still loads.

Notation: σ noise multiplier, q sample rate, T steps, δ target delta.
"""

from workbench.accounting.curve import check_history, history_epsilon
from workbench.accounting.registry import get_accountant
from workbench.checks import check_noise_multiplier, check_sample_rate, check_steps
from workbench.deprecation import warn_renamed

__all__ = ["Accountant", "accountant_class", "make_accountant"]


class Accountant:
    """History of (σ, q, T) groups; ε by the registered accountant named ``name``.

    A subclass with options returns them from ``_options()`` (passed to the ε function and
    saved in the state) and reads them back in ``_load_options``.
    """

    unit = "record"  # what ε protects; "user" under user-level DP (dpsgd/user_level.py)
    name = ""  # the registry's name of this accountant ("rdp", "pld", ...)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        old = cls.__dict__.get("mechanism")
        if isinstance(old, str):  # a subclass written for the previous release
            warn_renamed(f"{cls.__name__}.mechanism", "name", "Accountant subclass")
            cls.name = old
            del cls.mechanism  # the deprecated property below answers from now on

    @property
    def mechanism(self) -> str:
        """The old name of ``name`` (deprecated)."""
        warn_renamed("Accountant.mechanism", "Accountant.name", type(self).__name__)
        return self.name

    def __init__(self):
        self.history = []  # [(σ, q, T), ...], consecutive equal (σ, q) merged

    def step(self, *, noise_multiplier, sample_rate, steps=1):
        """Record ``steps`` steps with noise multiplier σ and sample rate q."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        steps = check_steps(steps)
        if steps == 0:
            return
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + steps)
        else:
            self.history.append((sigma, q, steps))

    def __len__(self):
        return sum(t for _, _, t in self.history)

    def __repr__(self):
        unit = "" if self.unit == "record" else f", unit={self.unit!r}"
        return f"{type(self).__name__}(steps={len(self)}, groups={len(self.history)}{unit})"

    def get_epsilon(self, delta):
        """ε(δ) of every step recorded so far."""
        return history_epsilon(self.history, delta, self.name, **self._options())

    def _options(self):
        """The accountant's options as plain Python values (also saved in the state)."""
        return {}

    def state_dict(self):
        """Plain Python state: {"name", "history": [[σ, q, T], ...], options...}."""
        return {"name": self.name, "history": [list(g) for g in self.history],
                **self._options()}

    def load_state_dict(self, state_dict):
        """Restore the history (and options) saved by ``state_dict()``; every key is required."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from state_dict(); got "
                            f"{type(state_dict).__name__}")
        if "mechanism" in state_dict and "name" not in state_dict:  # saved by the last release
            state_dict = {("name" if k == "mechanism" else k): v for k, v in state_dict.items()}
        if state_dict.get("name", self.name) != self.name:
            raise ValueError(f"state_dict is from a {state_dict.get('name')!r} accountant; "
                             f"this one is {self.name!r}")
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise KeyError(f"state_dict for a {self.name!r} accountant: missing keys "
                           f"{missing}, unexpected keys {unexpected}; pass the dict that "
                           f"{type(self).__name__}.state_dict() returned")
        history = check_history(state_dict["history"])  # all checked before anything changes
        self._load_options(state_dict)
        self.history = history

    def _load_options(self, state_dict):
        pass


_PLAIN: dict = {}  # id(spec) -> (spec, its plain class), for accountants registered without one


def accountant_class(name: str) -> type:
    """The stateful class of the accountant registered as ``name``: its own, or a plain
    history-keeping ``Accountant`` named after it (made once per registration)."""
    spec = get_accountant(name)
    if spec.accountant_class is not None:
        return spec.accountant_class
    if id(spec) not in _PLAIN:
        made = type(f"{spec.label}Accountant", (Accountant,),
                    {"name": spec.name, "__doc__": f"{spec.label} accountant."})
        _PLAIN[id(spec)] = (spec, made)  # the spec kept alive: its id stays its own
    return _PLAIN[id(spec)][1]


def make_accountant(name: str, **options) -> Accountant:
    """A fresh accountant by name: ``make_accountant("pld", discretization=1e-4)``.

    >>> import workbench.accounting  # registers the built-in accountants
    >>> make_accountant("pld", discretization=1e-3)
    PLDAccountant(steps=0, groups=0)
    """
    return accountant_class(name)(**options)
