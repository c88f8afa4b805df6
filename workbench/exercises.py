"""Checked exercises of the on-ramp (notebook 00b): ``check(name, your_function)``.

Each exercise is a function the learner writes; :func:`check` calls it on several inputs and
compares with the reference in :mod:`workbench.foundations` (relative tolerance 1e-9, both in
float64), and returns a :class:`Verdict` whose message says right, or wrong with the input,
what came back, what was expected and a hint. It never raises for a wrong answer, so a learner
sees the message and the notebook goes on, except when ``WORKBENCH_SOLUTIONS=1``: then the
notebook's hidden reference solutions are in force (:data:`SOLUTIONS`) and a wrong answer is
an :class:`ExerciseError`, so that CI (``make notebooks``) fails when a solution or a check
breaks. tests/test_exercises.py checks the "wrong" path.
"""

import math
import os
from dataclasses import dataclass

from workbench import foundations as F
from workbench.errors import WorkbenchError

#: True when the notebook should define the reference solutions (``WORKBENCH_SOLUTIONS=1``).
SOLUTIONS = os.environ.get("WORKBENCH_SOLUTIONS", "").strip().lower() in {"1", "true", "yes"}


class ExerciseError(WorkbenchError, AssertionError):
    """A reference solution failed its check (only with ``WORKBENCH_SOLUTIONS=1``)."""


@dataclass(frozen=True)
class Exercise:
    reference: object  # the function in workbench.foundations
    inputs: tuple  # argument tuples to try
    hint: str


EXERCISES = {
    "randomized_response_epsilon": Exercise(
        F.randomized_response_epsilon, ((0.5,), (0.0,), (0.25,), (0.9,)),
        "compare P[yes | truth yes] = (1 + p)/2 with P[yes | truth no] = (1 - p)/2: ε is the "
        "log of their ratio (p = 0.5 gives ln 3)"),
    "randomized_response_estimate": Exercise(
        F.randomized_response_estimate, ((0.5, 0.5), (0.6, 0.5), (0.3, 0.8), (0.9, 0.2)),
        "the observed fraction is f = p·π + (1 - p)/2 for a true fraction π: solve for π"),
    "laplace_scale": Exercise(
        F.laplace_scale, ((1.0, 1.0), (1.0, 0.5), (2.0, 0.1), (0.5, 3.0)),
        "more sensitivity needs more noise, a larger ε allows less noise"),
    "sum_sensitivity": Exercise(
        F.sum_sensitivity, ((0.0, 1.0, "add/remove"), (0.0, 1.0, "substitute"),
                            (-2.0, 1.0, "add/remove"), (-2.0, 1.0, "substitute")),
        "adding or removing a record changes the sum by that record's value, at most "
        "max(|lower|, |upper|); replacing one changes it by at most upper - lower"),
    "basic_composition": Exercise(
        F.basic_composition, (([1.0], [0.0]), ([0.5, 0.5, 1.0], [1e-6, 0.0, 1e-6]),
                              ([0.1] * 10, [1e-7] * 10)),
        "the εs add up and the δs add up"),
    "advanced_composition": Exercise(
        F.advanced_composition, ((0.1, 0.0, 100, 1e-5), (0.01, 1e-7, 1000, 1e-6),
                                 (1.0, 0.0, 10, 1e-3)),
        "ε' = sqrt(2k ln(1/δ')) ε + k ε (e^ε - 1) and δ_total = kδ + δ' "
        "(math.expm1(ε) is e^ε - 1)"),
    "group_privacy": Exercise(
        F.group_privacy, ((1.0, 1e-6, 1), (0.5, 1e-6, 2), (0.2, 1e-8, 20), (2.0, 0.0, 3)),
        "walk from x to x' one record at a time: the ratio e^ε is applied k times; each "
        "step's δ is multiplied by the e^ε of the steps after it, at most e^{(k-1)ε}"),
}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str

    def __str__(self):
        return self.message

    def _repr_pretty_(self, printer, cycle):
        printer.text(self.message)


def _close(got, want) -> bool:
    if isinstance(want, tuple):
        return (isinstance(got, (tuple, list)) and len(got) == len(want)
                and all(_close(g, w) for g, w in zip(got, want)))
    try:
        got = float(got)
    except (TypeError, ValueError):
        return False
    if math.isinf(want):
        return got == want
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


def _call(fn, args) -> str:
    return f"{getattr(fn, '__name__', 'your function')}{args!r}".replace(",)", ")")


def verdict(name: str, fn) -> Verdict:
    """Right or wrong (with the first failing input, the values and the hint) for ``fn``."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; the exercises are {sorted(EXERCISES)}")
    exercise = EXERCISES[name]
    for args in exercise.inputs:
        want = exercise.reference(*args)
        try:
            got = fn(*args)
        except Exception as err:  # noqa: BLE001  (the learner's code: report, not raise)
            return Verdict(False, f"✗ {_call(fn, args)} raised {type(err).__name__}: {err}. "
                                  f"Hint: {exercise.hint}.")
        if got is Ellipsis or got is None:
            return Verdict(False, f"✗ not filled in yet: {_call(fn, args)} returned {got!r}; "
                                  f"replace the `...` by your answer. Hint: {exercise.hint}.")
        if not _close(got, want):
            return Verdict(False, f"✗ {_call(fn, args)} returned {got!r}, expected {want!r}. "
                                  f"Hint: {exercise.hint}.")
    return Verdict(True, f"✓ right: {name} agrees with the reference on "
                         f"{len(exercise.inputs)} inputs.")


def check(name: str, fn) -> Verdict:
    """:func:`verdict`; with ``WORKBENCH_SOLUTIONS=1`` a wrong answer raises ExerciseError."""
    result = verdict(name, fn)
    if SOLUTIONS and not result.ok:
        raise ExerciseError(f"exercise {name}: the reference solution fails its check: "
                            f"{result.message}")
    return result


__all__ = ["EXERCISES", "SOLUTIONS", "Exercise", "ExerciseError", "Verdict", "check", "verdict"]
