"""The on-ramp's exercise checker: right answers pass, wrong ones fail with a hint."""

import math

import pytest

from workbench import exercises, foundations


@pytest.mark.parametrize("name", sorted(exercises.EXERCISES))
def test_the_reference_passes(name):
    result = exercises.verdict(name, getattr(foundations, name))
    assert result.ok and result.message.startswith("✓"), result.message


WRONG = {  # a plausible mistake for each exercise
    "randomized_response_epsilon": lambda p: math.log(1 / (1 - p)),
    "randomized_response_estimate": lambda f, p: f / p,
    "laplace_scale": lambda sensitivity, epsilon: epsilon / sensitivity,
    "sum_sensitivity": lambda lower, upper, neighbours="add/remove": upper - lower,
    "basic_composition": lambda es, ds: (sum(es), max(ds)),
    "advanced_composition": lambda e, d, k, dp: (math.sqrt(2 * k * math.log(1 / dp)) * e,
                                                 k * d + dp),
    "group_privacy": lambda e, d, k: (k * e, k * d),
}


def test_every_exercise_has_a_wrong_answer_here():
    assert set(WRONG) == set(exercises.EXERCISES)


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_answer_fails_with_the_input_and_the_hint(name):
    result = exercises.verdict(name, WRONG[name])
    assert not result.ok
    assert result.message.startswith("✗") and "expected" in result.message
    assert exercises.EXERCISES[name].hint in result.message


def test_a_stub_and_an_exception_are_reported_not_raised():
    def stub(sensitivity, epsilon):
        return ...

    def broken(sensitivity, epsilon):
        raise ZeroDivisionError("oops")

    assert "not filled in" in exercises.verdict("laplace_scale", stub).message
    message = exercises.verdict("laplace_scale", broken).message
    assert "ZeroDivisionError: oops" in message and "Hint" in message


def test_with_solutions_on_a_wrong_answer_raises(monkeypatch):
    monkeypatch.setattr(exercises, "SOLUTIONS", True)
    with pytest.raises(exercises.ExerciseError, match="laplace_scale"):
        exercises.check("laplace_scale", WRONG["laplace_scale"])
    assert exercises.check("laplace_scale", foundations.laplace_scale).ok
    monkeypatch.setattr(exercises, "SOLUTIONS", False)
    assert not exercises.check("laplace_scale", WRONG["laplace_scale"]).ok


def test_an_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="laplace_scale"):
        exercises.verdict("laplace", foundations.laplace_scale)
