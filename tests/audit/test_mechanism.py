"""audit_dp_step passes correct DP-SGD steps and flags every bug in the zoo.

Fixed seeds (G's design and the steps' noise) make every run identical, so the tests cannot
flake; the audit's own false-alarm bound (alpha = 1e-3, Bonferroni) is what a fresh seed
would risk. C = 1.5, not 1, so that noise std σ vs σC is visible.
"""

import matplotlib
import numpy as np
import pytest
import torch
from scipy import stats

from workbench.audit.bug_zoo import CORRECT, ZOO
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.mechanism import MechanismAudit, audit_dp_step

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DIM, C, SIGMA, B, TRIALS = 64, 1.5, 1.0, 8, 400

# the check each bug must fail (it may fail others too)
EXPECTED = {
    "inverted_clip_factor": "sensitivity",
    "clip_batch_gradient": "mean · designed batch",
    "noise_std_sigma_not_sigma_c": "noise variance",
    "noise_for_mean_applied_to_sum": "noise variance",
    "noise_for_sum_applied_to_mean": "noise variance",
    "noise_reused_across_steps": "noise is fresh",
    "per_coordinate_clipping": "mean · designed batch",
    "clip_norm_ten_percent_high": "mean · clip boundary",
    "clip_only_outliers": "mean · clip boundary",
    "no_noise": "noise variance",
    "divide_by_realised_batch": "mean · small batch (n=2)",
    "laplace_noise": "noise is Gaussian",
    "noise_clamped": "noise is Gaussian",  # the tails (a probe's, 2026-11-30)
    "noise_skipped_once": "noise variance",  # each call's noise
    "lone_record_unclipped": "mean · small batch (n=2)",  # its n = 1 batch
}


def audit(step_fn) -> MechanismAudit:
    return audit_dp_step(step_fn, DIM, B, C, SIGMA, trials=TRIALS,
                         generator=torch.Generator().manual_seed(0))


def test_every_bug_has_an_expected_check():
    assert set(EXPECTED) == set(ZOO) - {CORRECT}


def test_correct_step_passes():
    result = audit(ZOO[CORRECT](C, SIGMA, B, torch.Generator().manual_seed(1)))
    assert result.passed, result.table
    assert list(result.table.columns) == ["check", "statistic", "p_value", "threshold",
                                          "passed", "meaning"]
    assert len(result.table) == 10
    assert "passed" in result._repr_html_()
    fig, ax = plt.subplots()
    assert result.plot(ax)
    plt.close(fig)


@pytest.mark.slow
def test_workbench_optimizer_passes():
    result = audit(workbench_step(C, SIGMA, B, torch.Generator().manual_seed(2)))
    assert result.passed, result.table


def test_noise_free_audit_is_exact():
    result = audit_dp_step(workbench_step(C, 0.0, B), DIM, B, C, 0.0, trials=20)
    assert result.passed, result.table
    bad = audit_dp_step(ZOO["per_coordinate_clipping"](C, 0.0, B), DIM, B, C, 0.0, trials=20)
    assert not bad.passed


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_bug_is_flagged(bug):
    result = audit(ZOO[bug](C, SIGMA, B, torch.Generator().manual_seed(3)))
    assert result.passed is False
    failed = set(result.table.check[~result.table.passed])
    assert EXPECTED[bug] in failed, result.table


def test_opacus_optimizer_passes():
    opacus = pytest.importorskip("opacus.optimizers", reason="optional cross-check")
    p = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    opt = opacus.DPOptimizer(torch.optim.SGD([p], lr=0.0), noise_multiplier=SIGMA,
                             max_grad_norm=C, expected_batch_size=B)

    def step(G):
        opt.zero_grad(set_to_none=True)
        p.grad_sample = G  # (n, d): Opacus clips these, sums, adds noise, divides by B
        p.grad = G.sum(0)
        opt.step()
        return p.grad.detach().clone()

    torch.manual_seed(4)  # Opacus draws its noise from the global generator
    result = audit(step)
    assert result.passed, result.table


def test_false_alarms_at_the_smallest_trials_match_the_stated_level():
    """T = 20 (the smallest allowed), 400 seeds: each check's p-value is below 0.05 in at most
    5% of runs (+ slack), and the audit at alpha = 0.07 fails at most 7% (+ slack). Normal
    tails on the mean checks' t statistics (the old audit) give ~11% per mean check here."""
    seeds, T, dim = 400, 20, 8
    p, failed = [], 0
    for s in range(seeds):
        step = ZOO[CORRECT](C, SIGMA, B, torch.Generator().manual_seed(10 ** 6 + s))
        r = audit_dp_step(step, dim, B, C, SIGMA, trials=T, alpha=0.07,
                          generator=torch.Generator().manual_seed(s))
        p.append(r.table.p_value.to_numpy())
        failed += not r.passed
    below = (np.array(p) < 0.05).mean(0)  # (checks,) NaN (sensitivity) counts as never
    assert below.max() <= stats.binom.ppf(0.999, seeds, 0.05) / seeds, below
    assert failed / seeds <= stats.binom.ppf(0.999, seeds, 0.07) / seeds


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["clip_norm_ten_percent_high", "clip_only_outliers"])
def test_excess_clipping_is_caught_in_95_percent_of_runs(bug):
    """Default trials (400), d = 64, 20 seeds: measured 200/200 for both (see the report)."""
    caught = sum(not audit_dp_step(ZOO[bug](C, SIGMA, B, torch.Generator().manual_seed(s)),
                                   DIM, B, C, SIGMA,
                                   generator=torch.Generator().manual_seed(s)).passed
                 for s in range(20))
    assert caught >= 19


def test_excess_clipping_is_exact_without_noise():
    for bug in ("clip_norm_ten_percent_high", "clip_only_outliers"):
        r = audit_dp_step(ZOO[bug](C, 0.0, B), DIM, B, C, 0.0, trials=20)
        assert "mean · clip boundary" in set(r.table.check[~r.table.passed]), r.table
    r = audit_dp_step(ZOO[CORRECT](C, 0.0, B), DIM, B, C, 0.0, trials=20)
    assert r.passed, r.table


def test_clip_boundary_batch_straddles_c():
    from workbench.audit.mechanism import design_batches
    G = design_batches(DIM, B, C)["mean · clip boundary"]
    norms = G.norm(dim=1)
    assert norms.min() == pytest.approx(C / 2) and norms.max() == pytest.approx(8 * C)
    assert (norms < C).sum() == 8 and G[:, :-1].abs().max() == 0  # one coordinate only


def test_too_few_trials_is_an_error():
    with pytest.raises(ValueError, match="trials must be an integer >= 20"):
        audit_dp_step(ZOO[CORRECT](C, SIGMA, B), DIM, B, C, SIGMA, trials=19)


@pytest.mark.parametrize("k", [4.0])
def test_noise_clamped_beyond_three_sigma_is_flagged_by_its_atoms(k):
    """A clamp at ±4σC passed every check until 2026-11-30 (the tail count tests z = 3 only,
    and Kolmogorov-Smirnov on the Helmert mixtures is blind to it): the ~8 values of 128,000
    piled at the bound are an atom no continuous law has (``mechanism_noise.atoms_p``)."""
    from workbench.audit.bug_zoo import _clip_rows, _noise

    def clamped(C, sigma, B, generator=None):
        def step(G):
            z = _noise(G.shape[1], sigma * C, generator, G).clamp(-k * sigma * C, k * sigma * C)
            return (_clip_rows(G, C).sum(0) + z) / B
        return step

    result = audit_dp_step(clamped(C, SIGMA, B, torch.Generator().manual_seed(1)), 32, B, C,
                           SIGMA, trials=4000, generator=torch.Generator().manual_seed(0))
    table = result.table.set_index("check")
    assert not table.loc["noise is Gaussian", "passed"], table


def test_the_atom_test_passes_continuous_noise_in_any_float_and_reads_a_grid():
    """On a grid (bfloat16) the windows are two of its coarsest cells: not skipped (p = 1)
    as until 2026-12-01; test_noise_families.py has the grid's clamp."""
    from workbench.audit.mechanism_noise import atoms_p, coarsest
    rng = np.random.default_rng(0)
    for _ in range(20):
        z = rng.standard_normal((4000, 32))
        assert atoms_p(z, 1.0) > 1e-3
        assert atoms_p((z + 3.0).astype(np.float32).astype(np.float64) - 3.0, 1.0) > 1e-3
    grid = torch.tensor(rng.standard_normal((4000, 32)) + 1.0).bfloat16().double().numpy() - 1
    assert atoms_p(grid, 1.0, coarsest(torch.bfloat16, 1.0, 1.0)) > 1e-3
    assert atoms_p(rng.standard_normal((4000, 32)).clip(-4, 4), 1.0) < 1e-10


def test_a_step_returning_nan_raises_a_named_error_and_an_empty_batch_nan_fails_its_row():
    """A raw LinAlgError (an SVD of NaN residuals) until 2026-11-30."""
    from workbench.errors import NonFiniteStepError

    def on_empty(G):  # divides by the realised n: NaN on the empty batch only
        return G.clamp(-1, 1).sum(0) / G.shape[0]

    result = audit_dp_step(on_empty, 8, B, C, 0.0, trials=20)
    table = result.table.set_index("check")
    assert not table.loc["empty batch (n=0)", "passed"]
    assert "NonFiniteStepError" in table.loc["empty batch (n=0)", "meaning"]
    with pytest.raises(NonFiniteStepError, match="non-finite"):
        audit_dp_step(lambda G: torch.full((8,), float("nan"), dtype=G.dtype), 8, B, C, 0.0,
                      trials=20)


def test_an_opacus_style_clip_factor_is_exact_at_sigma_0():
    """C / (norm + 1e-6) over-clips by 1e-6 relative: harmless, and within a tolerance per
    row summed (the clip boundary batch sums ~20 rows: it failed until 2026-11-30)."""
    def step(G):
        c = (C / (G.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
        return (c * G).sum(0) / B

    assert audit_dp_step(step, 16, B, C, 0.0, trials=20).passed
