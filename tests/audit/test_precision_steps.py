"""Correct steps that compute in float32 or bfloat16 are held to their precision, not float64's.

A probe (2026-12-01) found a correct float32 step's claim refuted: removing a record moved its
noiseless sum by 1.00000006 C, past the record-influence audit's float64 tolerance (1e-9), and
the claim blamed coupling ("one record moves other records' contributions") beside a change
printed as "1 C (bound 1 C)"; a bfloat16 step's clipped sums "differed" too. Each comparison
now takes the tolerance of the precision the step's sums hold (``per_sample/precision.py``:
``value_dtype``), and prints the digits that show an excess.
"""

import pytest
import torch

from workbench.audit.bug_zoo import ZOO, _clip_rows, _noise
from workbench.audit.influence import audit_record_influence, change_text
from workbench.audit.influence_steps import influence_pool, step_released_sum
from workbench.audit.report_suites import check_clipping
from workbench.per_sample.precision import value_dtype, widest

B, DIM = 8, 32


def float32_step(C, sigma, B, generator=None):
    """A correct step computed in float32 (the probe's ``ok_float32``)."""
    def step(G):
        G = G.float()
        c = (C / G.norm(dim=1, keepdim=True)).clamp(max=1.0)
        z = torch.randn(G.shape[1], generator=generator, dtype=torch.float32) * (sigma * C)
        return ((c * G).sum(0) + z) / B
    return step


def bfloat16_step(C, sigma, B, generator=None):
    """A correct step whose update is returned in bfloat16."""
    return lambda G: ((_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, generator, G))
                      / B).to(torch.bfloat16)


def float32_inside(C, sigma, B, generator=None):
    """Computed in float32, returned as float64: its values still hold float32's bits."""
    step = float32_step(C, sigma, B, generator)
    return lambda G: step(G).double()


def influence(factory, C=1.0, seed=0):
    G = influence_pool(B, DIM, C, torch.Generator().manual_seed(seed))
    return audit_record_influence(step_released_sum(factory, G, C, B), B, max_grad_norm=C)


def test_value_dtype_reads_the_precision_a_result_holds():
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert value_dtype(x) == torch.float64
    assert value_dtype(x.float().double()) == torch.float32
    assert value_dtype(x.bfloat16().double()) == torch.bfloat16
    assert value_dtype(x.float()) == torch.float32
    assert widest([torch.bfloat16, torch.float32, torch.bfloat16]) == torch.float32


@pytest.mark.parametrize("factory, dtype", [(float32_step, "float32"),
                                            (float32_inside, "float32"),
                                            (bfloat16_step, "bfloat16")])
@pytest.mark.parametrize("C", [1.0, 1.5])
def test_a_correct_low_precision_step_keeps_the_bound(factory, dtype, C):
    result = influence(factory, C)
    assert result.passed, result.summary  # BROKEN (1.00000006 C > 1 + 1e-9) before
    assert result.dtype == dtype and dtype in result.summary
    check = check_clipping(factory, C, B, DIM, torch.Generator().manual_seed(0))
    assert check.passed, check.table  # bfloat16: "clipped sums differ" before


@pytest.mark.parametrize("bug", ["clip_norm_ten_percent_high", "inverted_clip_factor"])
def test_a_clip_bug_computed_in_float32_is_still_caught(bug):
    """float32's tolerance (1e-3) is far below a clipping bug's excess (10% and more)."""
    wrong = ZOO[bug]

    def in_float32(C, sigma, B, generator=None):
        step = wrong(C, sigma, B, generator)
        return lambda G: step(G).float()

    result = influence(in_float32)
    assert not result.passed and result.broken and result.dtype == "float32"


def test_an_excess_is_printed_with_the_digits_that_show_it():
    assert change_text(1.00000006, 1.0) == "1.00000006"
    assert change_text(1.0, 1.0) == "1" and change_text(1 + 2e-16, 1.0) == "1"
    assert change_text(1.4887, 2.0) == "1.4887"


def test_a_float32_step_does_not_refute_the_claims_relation_or_unit():
    """The CLI's ``--claim ... --step`` on a correct float32 step exited 1 before."""
    from pathlib import Path

    from workbench.audit.claim import load_claim
    from workbench.audit.claim_audit import SUPPORTED, audit_claim

    claim = load_claim(Path(__file__).parents[2] / "examples" / "claims" / "mnist_example.yaml")
    result = audit_claim(claim, step=float32_step, step_name="float32", trials=50)
    rows = result.table.set_index("element")
    for element in ("neighbouring relation", "unit of privacy"):
        assert rows.loc[element, "verdict"] == SUPPORTED, rows.loc[element, "finding"]
    assert "float32: tolerance 0.001" in rows.loc["neighbouring relation", "finding"]


def test_sigma_0_exact_checks_take_the_outputs_precision():
    """A correct bfloat16 step at σ = 0 failed every mean row (tolerance 1e-6 C/B); a clip
    norm 10% high in bfloat16 is still caught (bfloat16's unit roundoff, 2^-9, not the 5e-2
    that compares two computations: that one passed it)."""
    from workbench.audit.mechanism import audit_dp_step

    def run(factory):
        return audit_dp_step(factory(1.5, 0.0, B, torch.Generator().manual_seed(1)), DIM, B,
                             1.5, 0.0, trials=20, generator=torch.Generator().manual_seed(0))

    ok = run(bfloat16_step)
    assert ok.passed and ok.dtype == "bfloat16", ok.table
    wrong = ZOO["clip_norm_ten_percent_high"]
    def wrong_bf16(C, s, B, g=None):
        return lambda G: wrong(C, s, B, g)(G).to(torch.bfloat16)

    caught = run(wrong_bf16)
    assert caught.verdict == "failed", caught.table
    check = check_clipping(wrong_bf16, 1.5, B, DIM, torch.Generator().manual_seed(0))
    assert not check.passed and check.dtype == "bfloat16"
