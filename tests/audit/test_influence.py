"""Record-influence audit: each coupling case is flagged, the engine on the same models passes.

The invariant (``workbench.audit.influence``): removing one record moves the noiseless released
sum by at most C (replacing one, by at most 2C), at the precision the sums hold (float64 here:
tolerance 1e-7 relative; float32 and bfloat16 steps in test_precision_steps.py).
"""

import pytest
import torch
from torch import nn

from workbench.audit import bug_zoo
from workbench.audit import bug_zoo_coupling as coupling
from workbench.audit.influence import audit_record_influence
from workbench.audit.influence_steps import (
    engine_released_sum,
    influence_pool,
    naive_released_sum,
    step_released_sum,
)

DETERMINISTIC = [k for k in coupling.COUPLING if k != "mixing_dropout"]


@pytest.mark.parametrize("name", list(coupling.COUPLING))
def test_every_coupling_case_is_flagged(name):
    model, loss, x, y, C = coupling.COUPLING[name]()
    result = audit_record_influence(naive_released_sum(model, loss, x, y, C), coupling.N,
                                    max_grad_norm=C)
    assert not result.passed, result.summary
    assert result.worst("add/remove") > 1.0 + 1e-6
    assert "BROKEN" in result.summary


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_engine_and_naive_step_pass_with_plain_cross_entropy(name):
    model, loss, x, y, C = coupling.plain_case(name)
    for released in (engine_released_sum(model, loss, x, y, C),
                     naive_released_sum(model, loss, x, y, C)):
        result = audit_record_influence(released, coupling.N, max_grad_norm=C)
        assert result.passed, result.summary
        # some record is clipped: its removal moves the sum by exactly C
        assert result.worst("add/remove") == pytest.approx(1.0, abs=1e-9)


def test_the_tolerance_sees_half_a_percent():
    """ignore_index's token mean is only ~1.01 C: the audit must not round it away."""
    model, loss, x, y, C = coupling.COUPLING["ignore_index_mean"]()
    result = audit_record_influence(naive_released_sum(model, loss, x, y, C), coupling.N,
                                    max_grad_norm=C, relations=("add/remove",))
    assert 1.0 + 1e-6 < result.worst("add/remove") < 1.05
    assert set(result.table["relation"]) == {"add/remove"}


def test_engine_refuses_a_deterministic_sample_mixer():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(x - x.mean(0, keepdim=True))

    _, loss, x, y, C = coupling.plain_case("class_weighted_mean")
    with pytest.raises(Exception, match="(?i)mix|batch|independen"):
        audit_record_influence(engine_released_sum(Mixer(), loss, x, y, C), coupling.N,
                               max_grad_norm=C)


@pytest.mark.parametrize("bug", ["clip_norm_ten_percent_high", "inverted_clip_factor",
                                 "per_coordinate_clipping", "clip_only_outliers",
                                 "divide_by_realised_batch"])
def test_step_bugs_that_break_the_bound_are_flagged(bug):
    C, B = 1.5, 8
    G = influence_pool(B, 6, C, torch.Generator().manual_seed(0))
    result = audit_record_influence(step_released_sum(bug_zoo.ZOO[bug], G, C, B), B,
                                    max_grad_norm=C)
    assert not result.passed, result.summary


@pytest.mark.parametrize("step", ["correct", "noise_std_sigma_not_sigma_c", "laplace_noise"])
def test_steps_whose_sum_is_right_pass(step):
    """Noise bugs are invisible at σ = 0: the mechanism audits catch them, not this one."""
    C, B = 1.5, 8
    G = influence_pool(B, 6, C, torch.Generator().manual_seed(0))
    result = audit_record_influence(step_released_sum(bug_zoo.ZOO[step], G, C, B), B,
                                    max_grad_norm=C)
    assert result.passed, result.summary
    assert result.worst("substitution") <= 2.0


def test_unreplayable_randomness_is_refused():
    g = torch.Generator().manual_seed(0)

    def released_sum(idx):  # noise from a generator that is never re-seeded
        return torch.randn(3, generator=g, dtype=torch.float64)

    with pytest.raises(ValueError, match="not reproducible"):
        audit_record_influence(released_sum, 4, max_grad_norm=1.0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="relations"):
        audit_record_influence(lambda idx: torch.zeros(2), 3, max_grad_norm=1.0,
                               relations=("swap",))
    with pytest.raises(TypeError, match="Tensor"):
        audit_record_influence(lambda idx: [0.0], 3, max_grad_norm=1.0)
