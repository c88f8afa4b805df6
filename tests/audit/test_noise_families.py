"""Wrong noise that passed ``audit_dp_step`` until 2026-12-01 (a probe's findings), by family.

- Dependence across calls: the noise of L consecutive calls must sum to std sqrt(L)·s. Noise
  centred per epoch (its k draws sum to zero: the epoch's summed update is noise-free) passed
  every check at k = 100, 128 and 1000; lag 1 and pairwise cosines cannot see it. Now the sums
  over windows of L = 2, 4, ..., m calls are tested (``mechanism_noise.sums_p``).
- Bounded support: noise clamped at ±4σC passed when the step returned bfloat16 (the atom test
  skipped any grid), a Gaussian truncated at 3.5σ passed 9 runs in 10 (tails at z = 3 only).
  Now the largest value is tested exactly (``support_p``), the tails at several z, atoms on
  the output's own grid, and each run states the cut it resolves (``limits``).
- Scale: a step with 1.1x the claimed σ failed "noise is Gaussian" (tails counted against the
  claimed s); the shape is now tested at the measured scale and the mismatch named.

Settings of the command line's --quick (T = 200, d = 32, C = 1.5, σ = 0.7, B = 8), seeds fixed.
"""

import math

import numpy as np
import pytest
import torch

from workbench.audit.bug_zoo import CORRECT, ZOO, _clip_rows, _noise
from workbench.audit.mechanism import audit_dp_step
from workbench.audit.mechanism_noise import atoms_p, sums_p, support_p, tails_p
from workbench.audit.mechanism_power import POWER, clamp_cut, sums_resolution, support_cut

C, SIGMA, B, DIM, T = 1.5, 0.7, 8, 32, 200


def audit(factory, seed=1, trials=T, dim=DIM, claimed=SIGMA, sigma=SIGMA):
    return audit_dp_step(factory(C, sigma, B, torch.Generator().manual_seed(seed)), dim, B, C,
                         claimed, trials=trials, generator=torch.Generator().manual_seed(0),
                         twin=factory(C, sigma, B, torch.Generator().manual_seed(seed + 1)))


def failed(result):
    return set(result.table.check[~result.table.passed])


# --- dependence across calls ------------------------------------------------------------------

def zero_sum(k):
    """k draws at the start of each epoch of k calls, centred: each epoch's noise sums to 0."""
    def factory(C, sigma, B, generator=None):
        state = {"t": 0}

        def step(G):
            if state["t"] % k == 0:
                X = torch.randn(k, G.shape[1], generator=generator, dtype=torch.float64)
                state["Z"] = (X - X.mean(0)) * math.sqrt(k / (k - 1)) * sigma * C
            z = state["Z"][state["t"] % k]
            state["t"] += 1
            return (_clip_rows(G, C).sum(0) + z) / B
        return step
    return factory


def recycled(k=10, rho=0.5):
    """Each call's noise mixes in the noise of the call k calls before (its std still σC)."""
    def factory(C, sigma, B, generator=None):
        history = []

        def step(G):
            z = _noise(G.shape[1], sigma * C, generator, G)
            if len(history) >= k:
                z = rho * history[-k] + math.sqrt(1 - rho ** 2) * z
            history.append(z)
            return (_clip_rows(G, C).sum(0) + z) / B
        return step
    return factory


def periodic(k=50):
    """The same k noise vectors over and over (a generator re-seeded every k calls)."""
    def factory(C, sigma, B, generator=None):
        state = {"t": 0, "Z": []}

        def step(G):
            if state["t"] < k:
                state["Z"].append(_noise(G.shape[1], sigma * C, generator, G))
            z = state["Z"][state["t"] % k]
            state["t"] += 1
            return (_clip_rows(G, C).sum(0) + z) / B
        return step
    return factory


@pytest.mark.parametrize("factory", [zero_sum(100), zero_sum(128), zero_sum(1000),
                                     zero_sum(37), recycled(), periodic()],
                         ids=["zero-sum 100", "zero-sum 128", "zero-sum 1000", "zero-sum 37",
                              "recycled", "periodic"])
def test_noise_dependent_across_calls_is_not_fresh(factory):
    result = audit(factory)
    assert result.verdict == "failed" and "noise is fresh" in failed(result), result.table


def test_sums_have_the_power_they_state():
    """The sum of all m calls with its variance at the stated ρ_lo is caught in >= ~80% of
    runs (the design power), fresh noise in few; numpy only (no step)."""
    rng = np.random.default_rng(0)
    m, d, a = 1400, DIM, 1e-4 / 3
    lo = sums_resolution(m, d, a)[m][0]
    caught = null = 0
    for _ in range(100):
        X = rng.standard_normal((m, d))
        null += sums_p(X)[1] < a
        X -= (1 - math.sqrt(lo)) * X.mean(0)  # the total's variance scaled by ρ_lo exactly
        caught += sums_p(X)[1] < a
    assert null == 0 and caught >= 70  # binomial(100, 0.8): 70 is below its 1% quantile


def test_a_zero_sum_period_longer_than_the_run_is_stated_not_passed_silently():
    """k = 3000 > the 1400 designed calls: within one epoch the run's sum has ~half the
    variance, inside the stated band at L = 1400; the summary says so."""
    result = audit(zero_sum(3000))
    L, lo, hi = result.limits["sums"]
    assert L == 7 * T and lo > 0.5 * (1 - L / 3000) / (1 - 1 / 3000) * 0.3
    if result.passed:
        assert f"sums of {L} consecutive calls" in result.summary


# --- bounded support --------------------------------------------------------------------------

def cut(c, how="clamp", dtype=torch.float64):
    """Noise clamped, or truncated (resampled beyond), at ±c σC; the update in ``dtype``."""
    def factory(C, sigma, B, generator=None):
        def step(G):
            z = torch.randn(G.shape[1], generator=generator, dtype=torch.float64)
            if how == "clamp":
                z = z.clamp(-c, c)
            else:
                while (bad := z.abs() > c).any():
                    z[bad] = torch.randn(int(bad.sum()), generator=generator,
                                         dtype=torch.float64)
            return ((_clip_rows(G, C).sum(0) + z * sigma * C) / B).to(dtype)
        return step
    return factory


@pytest.mark.parametrize("factory", [cut(3.5, "truncate"), cut(3.5, "clamp", torch.bfloat16),
                                     cut(3.5, "truncate", torch.float32), cut(3.0, "clamp")],
                         ids=["truncated 3.5", "clamped 3.5 bf16", "truncated 3.5 f32",
                              "clamped 3"])
def test_a_cut_within_the_stated_limit_is_caught(factory):
    result = audit(factory)
    assert result.verdict == "failed" and "noise is Gaussian" in failed(result), result.table


@pytest.mark.parametrize("factory", [cut(4.0, "clamp", torch.bfloat16), cut(4.0, "truncate")],
                         ids=["clamped 4 bf16", "truncated 4"])
def test_a_cut_beyond_the_resolution_is_not_claimed(factory):
    """At --quick's size no test sees a cut at 4σ with certainty: the run says it cannot."""
    result = audit(factory)
    assert result.limits["noise cut"] < 4.0
    if result.verdict != "failed":
        assert "noise cut (clamped or truncated) beyond 3." in result.summary
        row = result.table.set_index("check").loc["noise is Gaussian", "meaning"]
        assert "a cut beyond is not seen" in row


def test_the_stated_cut_is_caught_with_certainty_and_the_clamp_with_its_power():
    """numpy only: N values truncated at the stated c_cut are always rejected by the support
    test; clamped at c_clamp, by the atoms in >= ~80% of runs."""
    rng = np.random.default_rng(1)
    n, a = 60_000, 1e-4 / 4
    c = support_cut(n, a, dof=10**9)
    cc = clamp_cut(n, a)
    assert 3.6 < c < cc < 4.1
    hits = 0
    for _ in range(50):
        x = rng.standard_normal(n)
        x[np.abs(x) > c] = np.sign(x[np.abs(x) > c]) * rng.uniform(0, c, (np.abs(x) > c).sum())
        assert support_p(x, 1.0) <= a
        hits += atoms_p(rng.standard_normal(n).clip(-cc, cc), 1.0) <= a
    assert hits >= 0.8 * POWER * 50


def test_the_tails_and_atoms_pass_gaussian_noise_on_any_grid():
    """No false alarm in float64, float32 or on a bfloat16 grid (its windows two of the grid's
    coarsest cells), and a clamp on a bfloat16 grid with enough mass at its bound is caught
    (a grid was skipped, p = 1, before)."""
    from workbench.audit.mechanism_noise import cells, coarsest
    rng = np.random.default_rng(0)
    grid = coarsest(torch.bfloat16, 0.13, 0.4)  # outputs y = 0.4 + n, n ~ N(0, 0.13²)
    for _ in range(10):
        z = rng.standard_normal((4000, 32))
        y = torch.tensor(z * 0.13 + 0.4).bfloat16().double().numpy()  # a bf16 output, μ = 0.4
        assert atoms_p(y - 0.4, 0.13, grid) > 1e-3 and tails_p(y - 0.4, 0.13) > 1e-3
        assert support_p(y - 0.4, 0.13, cells(y, torch.bfloat16, 0.13)) > 1e-3
        assert atoms_p(z, 1.0) > 1e-3
        assert atoms_p((z + 3.0).astype(np.float32).astype(np.float64) - 3.0, 1.0) > 1e-3
    y = torch.tensor(rng.standard_normal((40000, 32)).clip(-3.5, 3.5) * 0.13 + 0.4)
    y = y.bfloat16().double().numpy()
    assert atoms_p(y - 0.4, 0.13, grid) < 1e-10


# --- scale ------------------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [1.1, 0.9])
def test_a_scale_error_is_named_as_one_and_the_shape_still_passes(factor):
    def scaled(C, sigma, B, generator=None):
        return ZOO[CORRECT](C, factor * sigma, B, generator)

    result = audit(scaled)
    assert "noise variance" in failed(result), result.table
    assert "noise is Gaussian" not in failed(result), result.table  # it failed too before
    assert failed(result) <= {"noise variance", "empty batch (n=0)", "sizes and scales"}
    assert result.noise_scale == pytest.approx(factor, rel=0.02)
    assert "scale mismatch" in result.summary
    assert ("safer" in result.summary) == (factor > 1)
    assert ("understates" in result.summary) == (factor < 1)


def test_a_safer_step_is_refuted_as_a_scale_mismatch_not_as_non_gaussian_noise():
    """audit_claim on a step with 1.1x the claimed σ: the step is not the claimed one, but the
    finding says why (its scale) and that it is safer; "noise is Gaussian" failed before."""
    from pathlib import Path

    from workbench.audit.claim import load_claim
    from workbench.audit.claim_audit import REFUTED, audit_claim

    claim = load_claim(Path(__file__).parents[2] / "examples" / "claims" / "mnist_example.yaml")
    safer = audit_claim(claim, step=lambda C, s, B, g=None: ZOO[CORRECT](C, 1.1 * s, B, g),
                        step_name="1.1 σ", trials=50)
    row = safer.table.set_index("element").loc["step: noise σ·C on the clipped sum"]
    assert row["verdict"] == REFUTED and "noise is Gaussian" not in row["finding"]
    assert "scale mismatch" in row["finding"] and "safer" in row["finding"]
