"""A privacy claim as data: what a DP-SGD run promises, element by element.

The elements are those a privacy statement must state (Ponomareva et al. 2023, "How to DP-fy
ML", Sec. 5.3; TF Privacy's privacy statement): the unit of privacy, the neighbouring
relation, the sampler, the sampling rate q (or batch size B and data set size N, q = B/N), the
noise multiplier σ, the clip norm C, the length (steps T, or epochs E with T = E·round(1/q)),
δ, the accountant, the claimed ε, and what the accounting covers (hyperparameter tuning runs,
pretraining). ``Claim.from_file`` reads it from YAML or JSON::

    subject: MNIST CNN trained with workbench.PrivacyEngine
    unit: record                 # or user (dataset_size, q then count users)
    neighbouring: add/remove     # or substitution
    sampler: poisson             # or shuffle, deterministic (workbench.accounting.SAMPLERS)
    dataset_size: 60000
    batch_size: 256              # or sample_rate: 0.004267
    noise_multiplier: 1.1
    max_grad_norm: 1.0
    epochs: 60                   # or steps: 14040
    delta: 1.0e-5
    accountant: rdp              # workbench.accounting.ACCOUNTANTS
    epsilon: 2.92
    covers: {tuning_runs: 1, pretraining: none}

Every problem raises :class:`ClaimError` (an ``InputError``: the CLI prints one line and
exits 2) naming the field, the value and the fix; δ must be below 1/N (a δ of 1/N lets the
mechanism publish one record in the clear).
"""

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from workbench import accounting
from workbench.audit.cli_inputs import InputError

UNITS = {"record": "one training example (record-level DP)",
         "user": "one user with all of their records (user-level DP: dataset_size is the "
                 "number of users, q the users' sample rate; dpsgd/user_level.py)"}
"""unit -> meaning."""
NEIGHBOURING = {"add/remove": "add or remove one unit", "substitution": "replace one unit"}
PRETRAINING = ("none", "public data", "included in the accounting", "not covered")


class ClaimError(InputError):
    """An invalid claim file (exit code 2)."""


@dataclass(frozen=True)
class Claim:
    """One privacy claim; ``sample_rate`` and ``steps`` are derived when not given."""

    neighbouring: str
    sampler: str
    dataset_size: int
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    accountant: str
    epsilon: float
    unit: str = "record"
    sample_rate: float | None = None
    batch_size: int | None = None
    steps: int | None = None
    epochs: float | None = None
    covers: dict = field(default_factory=lambda: {"tuning_runs": 1, "pretraining": "none"})
    subject: str = ""

    @property
    def q(self) -> float:
        return self.sample_rate if self.sample_rate is not None else \
            self.batch_size / self.dataset_size

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else \
            accounting.steps_from_epochs(self.epochs, self.q)

    @property
    def total_epochs(self) -> float:
        return self.epochs if self.epochs is not None else self.total_steps * self.q

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.dataset_size

    @property
    def tuning_runs(self) -> int:
        return int(self.covers.get("tuning_runs", 1))

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict, source: str = "the claim") -> "Claim":
        return validate(data, source)

    @classmethod
    def from_file(cls, path) -> "Claim":
        return load_claim(path)


def load_claim(path) -> Claim:
    """A :class:`Claim` from a .yaml/.yml or .json file."""
    path = Path(path)
    if not path.is_file():
        raise ClaimError(f"--claim {str(path)!r}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # noqa: BLE001  (any parse error is the user's input)
        raise ClaimError(f"--claim {str(path)!r} is not valid "
                         f"{'JSON' if path.suffix.lower() == '.json' else 'YAML'}: "
                         f"{' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise ClaimError(f"--claim {str(path)!r} must hold a mapping of fields (unit, "
                         f"neighbouring, sampler, ...); got {type(data).__name__}")
    return validate(data, f"--claim {str(path)!r}")


def _number(data, key, src, low=0.0, integer=False, low_open=True):
    v = data.get(key)
    if isinstance(v, str):  # (YAML 1.1 reads ``1e-5``, without a dot, as a string)
        try:
            v = float(v.strip())
        except ValueError:
            pass
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
        (v > low if low_open else v >= low) and (not integer or float(v).is_integer())
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ClaimError(f"{src}: {key} must be {kind} {'>' if low_open else '>='} {low:g}; "
                         f"got {v!r}")
    return int(v) if integer else float(v)


def _choice(data, key, choices, src, default=None, note=""):
    v = data.get(key, default)
    if v not in choices:
        raise ClaimError(f"{src}: unknown {key} {v!r}; choose one of "
                         f"{', '.join(map(repr, choices))}{note}")
    return v


REQUIRED = ("neighbouring", "sampler", "dataset_size", "noise_multiplier", "max_grad_norm",
            "delta", "accountant", "epsilon")


def validate(data: dict, src: str = "the claim") -> Claim:
    if isinstance(data, dict):  # a field left empty (YAML's ``epochs:``, JSON's null) is
        data = {k: v for k, v in data.items() if v is not None}  # not given (beside
        # steps it was "not both" until 2026-11-30; alone, a missing field as before)
    known = {f.name for f in fields(Claim)}
    extra = sorted(set(data) - known)
    if extra:
        raise ClaimError(f"{src}: unknown field(s) {', '.join(extra)}; the fields are "
                         f"{', '.join(sorted(known))}")
    missing = [k for k in REQUIRED if k not in data]
    if "sample_rate" not in data and "batch_size" not in data:
        missing.append("sample_rate or batch_size")
    if "steps" not in data and "epochs" not in data:
        missing.append("steps or epochs")
    if missing:
        raise ClaimError(f"{src}: missing field(s) {', '.join(missing)}")
    for one, other in (("sample_rate", "batch_size"), ("steps", "epochs")):
        if one in data and other in data:  # the second was dropped silently until
            # 2026-11-30: batch_size 256 of 60000 beside sample_rate 0.001, ε 1.15 for 2.59
            raise ClaimError(f"{src}: give {one} or {other}, not both ({one} {data[one]!r}, "
                             f"{other} {data[other]!r}): each fixes the other, and the audit "
                             f"cannot tell which one the run used")
    out = {"unit": _choice(data, "unit", tuple(UNITS), src, "record", ""),
           "neighbouring": _choice(data, "neighbouring", tuple(NEIGHBOURING), src),
           "sampler": _choice(data, "sampler", tuple(accounting.SAMPLERS), src),
           "accountant": _choice(data, "accountant", tuple(accounting.ACCOUNTANTS), src),
           "dataset_size": _number(data, "dataset_size", src, 1, integer=True, low_open=False),
           "noise_multiplier": _number(data, "noise_multiplier", src, 0.0),
           "max_grad_norm": _number(data, "max_grad_norm", src, 0.0),
           "epsilon": _number(data, "epsilon", src, 0.0),
           "delta": _number(data, "delta", src, 0.0),
           "subject": str(data.get("subject", ""))}
    N = out["dataset_size"]
    if out["delta"] >= 1 / N:
        raise ClaimError(f"{src}: delta {out['delta']:g} >= 1/N = {1 / N:.3g} (N = "
                         f"dataset_size {N}): such a δ allows publishing a record in the clear; "
                         f"use δ well below 1/N (e.g. 1/N²)")
    if "sample_rate" in data:
        out["sample_rate"] = _number(data, "sample_rate", src, 0.0)
        if out["sample_rate"] > 1:
            raise ClaimError(f"{src}: sample_rate must be in (0, 1]; got {out['sample_rate']}")
    else:
        out["batch_size"] = _number(data, "batch_size", src, 0, integer=True)
        if out["batch_size"] > N:
            raise ClaimError(f"{src}: batch_size {out['batch_size']} > dataset_size {N}")
    if "steps" in data:
        out["steps"] = _number(data, "steps", src, 0, integer=True)
    else:
        out["epochs"] = _number(data, "epochs", src, 0.0)
    out["covers"] = _covers(data.get("covers", {}), src)
    return Claim(**out)


def _covers(covers, src) -> dict:
    if not isinstance(covers, dict) or set(covers) - {"tuning_runs", "pretraining"}:
        raise ClaimError(f"{src}: covers must be a mapping with tuning_runs (an integer >= 1: "
                         f"the runs the ε accounts for) and pretraining (one of "
                         f"{', '.join(PRETRAINING)}); got {covers!r}")
    runs = _number({"tuning_runs": covers.get("tuning_runs", 1)}, "tuning_runs",
                   f"{src}: covers", 1, integer=True, low_open=False)
    pre = covers.get("pretraining", "none")
    if pre not in PRETRAINING:
        raise ClaimError(f"{src}: covers.pretraining {pre!r}: choose one of "
                         f"{', '.join(map(repr, PRETRAINING))}")
    return {"tuning_runs": runs, "pretraining": pre}


__all__ = [
    "NEIGHBOURING", "PRETRAINING", "REQUIRED", "UNITS", "Claim", "ClaimError", "load_claim",
    "validate",
]
