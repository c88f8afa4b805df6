"""A small real audit report for the report tests: every built-in section kind, in seconds.

Real audit results (not mocks) at tiny sizes: a gradient audit of a two-layer MLP, the
mechanism audit of the correct step and of two bugs, a σ = 0 clipping check, canary audits
with and without noise, the accountants, one skipped and one informational section, a library
that cannot run one model (not applicable on it) and one that cannot run any, a record-influence
audit, and a small privacy claim (the cover); sections in three parts (subject, self-checks,
other libraries).
"""

import torch
from torch import nn

from workbench.audit import bug_zoo
from workbench.audit.canary import audit_canaries
from workbench.audit.claim import validate
from workbench.audit.claim_audit import audit_claim
from workbench.audit.gradients import audit_gradients
from workbench.audit.influence import audit_record_influence
from workbench.audit.influence_steps import influence_pool, step_released_sum
from workbench.audit.mechanism import audit_dp_step
from workbench.audit.report import LIBRARY, SELF_CHECK, Skipped, section
from workbench.audit.report_provenance import provenance
from workbench.audit.report_suites import (
    BugZooSuite,
    GradientSuite,
    check_accountants,
    check_clipping,
)

C, SIGMA, B, DIM, TRIALS = 1.5, 1.0, 8, 16, 60


def tiny_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, nn.CrossEntropyLoss(reduction="none"), torch.randn(5, 3), \
        torch.tensor([0, 1, 1, 0, 1])


def mechanism(factory):
    return audit_dp_step(factory(C, SIGMA, B, torch.Generator().manual_seed(1)), dim=DIM,
                         batch_size=B, max_grad_norm=C, noise_multiplier=SIGMA, trials=TRIALS,
                         generator=torch.Generator().manual_seed(0))


def canary(factory):
    return audit_canaries(factory, dim=200, steps=4, sample_rate=0.5, max_grad_norm=C,
                          noise_multiplier=4.0, canaries=200, guesses=80,
                          generator=torch.Generator().manual_seed(0))


def small_sections():
    model, loss_fn, x, y = tiny_case()

    def swapped(model, loss_fn, inputs, targets):  # a wrong provider: samples 0 and 1 swap
        from workbench import per_sample_gradients
        g = per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")
        return {k: v[[1, 0, 2, 3, 4]] for k, v in g.items()}

    def picky(model, loss_fn, inputs, targets):  # a library that cannot run Tanh
        from workbench import per_sample_gradients
        if any(isinstance(m, nn.Tanh) for m in model.modules()):
            raise NotImplementedError("picky has no rule for Tanh")
        return per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")

    libs = {"swapped": swapped, "picky": picky}
    linear = nn.Sequential(nn.Linear(3, 2))
    audits = {"mlp": audit_gradients(model, loss_fn, x, y, methods=("einsum", "bookkeeping"),
                                     providers=libs),
              "linear": audit_gradients(linear, loss_fn, x, y, methods=("einsum",),
                                        providers=libs)}
    zoo = {k: mechanism(bug_zoo.ZOO[k]) for k in ("no_noise", "inverted_clip_factor")}
    G = influence_pool(4, 6, C, torch.Generator().manual_seed(0))
    influence = audit_record_influence(step_released_sum(bug_zoo.correct_step, G, C, B), 4,
                                       max_grad_norm=C)
    return [
        section("gradients", GradientSuite(audits, ("einsum", "bookkeeping"))),
        section("library swapped", GradientSuite(audits, ("swapped",), library=True),
                must_pass=False),
        section("library picky", GradientSuite(audits, ("picky",), library=True),
                must_pass=False),
        section("library picky on mlp", GradientSuite({"mlp": audits["mlp"]}, ("picky",),
                                                      library=True), must_pass=False),
        section("library absent", Skipped("nolib is not installed (pip install nolib)"),
                must_pass=False, part=LIBRARY),
        section("step", mechanism(bug_zoo.correct_step)),
        section("record influence", influence),
        section("clipping", check_clipping(bug_zoo.correct_step, C, B, DIM)),
        section("zoo", BugZooSuite(zoo, {k: "a bug" for k in zoo}), part=SELF_CHECK),
        section("canary", canary(bug_zoo.correct_step)),
        section("leak", canary(bug_zoo.no_noise), expect_failure=True, part=SELF_CHECK),
        section("accountants", check_accountants([(0.01, 1.0, 100)], curve_points=3)),
    ]


SMALL_CLAIM = dict(subject="a tiny MLP", neighbouring="add/remove", sampler="poisson",
                   dataset_size=1000, batch_size=50, noise_multiplier=1.0, max_grad_norm=2.0,
                   steps=40, delta=1e-5, accountant="rdp", epsilon=3.0)


def small_claim():
    """The claim audit of a small honest claim on the reference step (the cover)."""
    return audit_claim(validate(SMALL_CLAIM), step=bug_zoo.correct_step,
                       step_name="bug_zoo.correct_step", trials=TRIALS)


def small_provenance():
    return provenance(["--quick", "--out", "some dir"], {"quick": "True"}, {"canary": 0})
