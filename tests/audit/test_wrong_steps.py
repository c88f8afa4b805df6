"""audit_dp_step against steps wrong in one part only (``bug_zoo_parts``), and its verdict when
a run is too small to see a 10% error ("inconclusive", ``mechanism_power``).

Fixed seeds make every run identical (no flakes). Before the audit was strengthened,
per-layer clipping passed in 2 of 3 seeds, a norm leaving out one parameter, a NaN record given
full weight and one parameter without noise passed always, and a run of 20 trials on 4
coordinates said "passed" for a step whose noise is 0.9x the claim.
"""

import math

import numpy as np
import pytest
import torch

from workbench.audit import mechanism_noise
from workbench.audit.bug_zoo import CORRECT, ZOO, _clip_rows, _noise
from workbench.audit.bug_zoo_parts import PARTS
from workbench.audit.mechanism import MAX_DIM, MAX_REPEATS, audit_dp_step, boundary_norms
from workbench.audit.mechanism_power import TARGETS, resolution
from workbench.audit.report_suites import BugZooSuite

DIM, C, SIGMA, B = 64, 1.5, 0.7, 8  # σ != 1: σ² and √σ differ from σ

EXPECTED = {  # the check each must fail (it may fail others too)
    "per_layer_clipping": "mean · designed batch",
    "norm_leaves_out_a_parameter": "mean · designed batch",
    "unclipped_bias": "mean · designed batch",
    "noise_missing_on_a_parameter": "noise variance",
    "nan_record_full_weight": "sensitivity",
    "noise_seed_with_a_period": "noise is fresh",
    "noise_scaled_by_realised_batch": "noise variance",
    "noise_shared_by_two_coordinates": "noise variance",  # every direction: passed before
    "no_noise_on_an_empty_batch": "empty batch (n=0)",  # no batch was empty before
    # passed every section of the command line's audit until 2026-11-30 (a review's probe):
    "clip_factor_floored": "sizes and scales",  # no designed record above 100C
    "clip_on_first_physical_batch_only": "sizes and scales",  # no designed batch above 32
    "small_batches_unclipped": "sizes and scales",  # no record above C at 2 <= n <= 5
    "noise_per_accumulated_chunk": "sizes and scales",  # likewise, the noise
    "noise_std_sigma_squared": "noise variance",  # the command line ran at σ = 1
    "noise_seeded_when_built": "noise is fresh",  # no second step built apart
}


def scaled_noise(factor):
    def factory(C, sigma, B, generator=None):
        return lambda G: (_clip_rows(G, C).sum(0)
                          + _noise(G.shape[1], factor * sigma * C, generator, G)) / B
    return factory


def audit(factory, seed=3, dim=DIM, trials=400, sigma=SIGMA):
    return audit_dp_step(factory(C, sigma, B, torch.Generator().manual_seed(seed)), dim, B, C,
                         sigma, trials=trials, generator=torch.Generator().manual_seed(0),
                         twin=factory(C, sigma, B, torch.Generator().manual_seed(seed + 1)))


def test_every_part_bug_has_an_expected_check():
    assert set(EXPECTED) == set(PARTS)


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_part_bug_is_flagged_at_the_defaults(bug):
    result = audit(PARTS[bug])
    assert result.verdict == "failed" and not result.passed
    assert EXPECTED[bug] in set(result.table.check[~result.table.passed]), result.table


def test_correct_step_passes_and_resolves_ten_percent():
    result = audit(ZOO[CORRECT])
    assert result.verdict == "passed" and result.passed, result.table
    assert all(result.resolution[k] <= TARGETS[k] for k in TARGETS), result.resolution
    assert "passed" in result.summary


def test_noise_checks_at_two_coordinates_do_not_false_alarm():
    """d = 2: the cosine of two noise vectors is spread over [-1, 1]; the exact-repeat check
    must still not fire on fresh noise."""
    assert audit(ZOO[CORRECT], dim=2, trials=200).verdict != "failed"


@pytest.mark.parametrize("factor", [1.0, 0.9, 1.1])
def test_a_run_too_small_to_see_ten_percent_does_not_pass(factor):
    """20 trials on 4 coordinates resolve the noise std to ~26%: a 0.9x or 1.1x noise passed."""
    result = audit(scaled_noise(factor), dim=4, trials=20)
    assert not result.passed and result.verdict in ("inconclusive", "failed")
    assert result.resolution["noise std"] > TARGETS["noise std"]
    if result.verdict == "inconclusive":
        assert "inconclusive at this sample size" in result.summary
        assert result.trials_needed > 20 and f"trials >= {result.trials_needed}" in result.summary
        assert audit(scaled_noise(1.0), dim=4, trials=result.trials_needed).verdict == "passed"


def test_stated_resolution_is_the_power_it_claims():
    """A noise std off by exactly the stated resolution is caught in about 80% of runs (the
    design power): 30 trials, d = 8, 30 seeds; measured 30/40 and 36/40 (clip) in the report."""
    T, d = 30, 8
    res = resolution(T, d, SIGMA, 6, boundary_norms(1).numpy(), 1e-3 / 8)
    caught = sum(audit(scaled_noise(1 - res["noise std"]), seed=500 + s, dim=d, trials=T)
                 .verdict == "failed" for s in range(30))
    assert 16 <= caught <= 30  # binomial(30, 0.8): 16 is below its 0.1% quantile


def test_large_sigma_keeps_the_clip_resolution():
    """The clip-boundary batch grows with σ (ceil σ copies), so σ = 10 still sees 1.1 C."""
    res = resolution(400, DIM, 10.0, 6, boundary_norms(math.ceil(10.0)).numpy(), 1e-3 / 8)
    assert res["clip norm"] <= TARGETS["clip norm"]


def test_an_inconclusive_run_caught_no_bug():
    """The CLI's bug-zoo suite counted any run that did not pass as 'caught'."""
    result = audit(ZOO["clip_norm_ten_percent_high"], dim=4, trials=20)
    suite = BugZooSuite({"clip_norm_ten_percent_high": result}, {})
    assert bool(suite.table["caught"][0]) == (result.verdict == "failed")
    assert suite.passed == (result.verdict == "failed")


@pytest.mark.parametrize("layers", [2, 4, [1], [5]], ids=["halves", "quarters", "bias", "5|27"])
def test_per_layer_clipping_is_caught_at_the_quick_audit_setting(layers):
    """The CLI's --quick setting (d = 32, 60 trials): per-layer clipping into halves passed
    when one huge dense record was all that showed it; the dense copies show any split."""
    factory = PARTS["per_layer_clipping"]
    step = factory(C, SIGMA, B, torch.Generator().manual_seed(1), layers=layers)
    result = audit_dp_step(step, 32, B, C, SIGMA, trials=60,
                           generator=torch.Generator().manual_seed(0))
    assert result.verdict == "failed"
    assert "mean · designed batch" in set(result.table.check[~result.table.passed]), result.table


def nan_entries_zeroed(C, sigma, B, generator=None):
    """A defensible step: a record's NaN entries zeroed, the rest clipped to C as usual (its
    weight is at most C, so the sensitivity claim holds)."""
    return lambda G: (_clip_rows(torch.nan_to_num(G), C).sum(0)
                      + _noise(G.shape[1], sigma * C, generator, G)) / B


def test_a_nan_record_clipped_to_c_is_not_a_repeated_noise():
    """The NaN batch's mean is unknown (any weight up to C is fine): its outputs centred on the
    mean without that record shared a shift of up to C/B, which the repeat check took for
    reused noise at small σ."""
    result = audit(nan_entries_zeroed, sigma=0.1)
    assert result.verdict == "passed", result.table


def test_repeat_check_tiles_agree_with_the_whole_gram_matrix(monkeypatch):
    """Tiles of 16 calls: the largest |cosine| equals the whole matrix's, and a repeat is found
    across tiles (memory O(BLOCK²) whatever the number of calls)."""
    monkeypatch.setattr(mechanism_noise, "BLOCK", 16)
    X = np.random.default_rng(0).standard_normal((100, 8))
    unit = X / np.linalg.norm(X, axis=1, keepdims=True)
    best, same = mechanism_noise._cosines_max(X)
    assert best == pytest.approx(np.abs(np.triu(unit @ unit.T, 1)).max(), abs=1e-12)
    assert not same
    X[90] = X[3]
    assert mechanism_noise._cosines_max(X) == (pytest.approx(1.0), True)
    X[90] = 2 * X[3]  # parallel but not equal: a near-repeat, not an exact one
    assert mechanism_noise._cosines_max(X) == (pytest.approx(1.0), False)


def test_huge_sigma_caps_the_design_and_says_how_many_trials():
    """σ = 1000 would ask for 1000 copies of the clip-boundary rows: capped at MAX_REPEATS,
    the run is inconclusive and names the trials that resolve 10% in the clip norm."""
    rows = []
    correct = ZOO[CORRECT](C, 1000.0, B, torch.Generator().manual_seed(1))

    def step(G):
        rows.append(G.shape[0])
        return correct(G)

    result = audit(lambda *args: step, dim=4, trials=20, sigma=1000.0)
    assert max(rows) == 32 * MAX_REPEATS
    assert result.verdict == "inconclusive" and result.resolution["clip norm"] > 0.1
    assert result.trials_needed > 20 and f"trials >= {result.trials_needed}" in result.summary
    again = audit(lambda *args: step, dim=4, trials=result.trials_needed, sigma=1000.0)
    assert again.verdict == "passed", again.table


@pytest.mark.parametrize("dim", [1, MAX_DIM + 1])
def test_dim_outside_the_design_is_an_error(dim):
    """The outlier-per-coordinate batch has dim² entries: a dim of a real model's parameter
    count (10^6) would need 8 TB, so the audit refuses it by name instead of running out."""
    with pytest.raises(ValueError, match=rf"dim must be an integer in \[2, {MAX_DIM}\]"):
        audit_dp_step(ZOO[CORRECT](C, SIGMA, B), dim, B, C, SIGMA, trials=20)


def test_a_step_that_raises_on_an_empty_batch_fails_that_row_by_name():
    def factory(C, sigma, B, generator=None):
        def step(G):
            if G.shape[0] == 0:
                raise RuntimeError("no records")
            return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
        return step

    result = audit(factory, trials=20)
    row = result.table.set_index("check").loc["empty batch (n=0)"]
    assert not row["passed"] and "raised RuntimeError" in row["meaning"]
    assert result.table["passed"].sum() == len(result.table) - 1  # that row alone


def test_the_every_direction_bound_never_alarms_on_gaussian_noise():
    from workbench.audit.mechanism_noise import direction_p

    rng = np.random.default_rng(0)
    for m, d in [(2800, 64), (70, 64), (152, 32)]:
        assert min(direction_p(rng.standard_normal((m, d))) for _ in range(20)) > 0.1
    H = rng.standard_normal((2800, 64))
    H[:, 1] = H[:, 0]  # one direction without noise
    assert direction_p(H) < 1e-100
