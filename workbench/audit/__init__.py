"""Audits: check a DP-SGD implementation against the workbench's obviously-correct twins.

``audit_gradients`` compares per-sample gradients (and ghost norms, clipped sums) of any
method or library with micro-batching, the reference of Opacus' own tests (Yousefpour et
al. 2021, arXiv 2109.12298, Appendix A); ``providers`` adapts torch.func, Opacus, BackPACK.
``audit_dp_step`` tests one privatised step against the claim (Σ_i clip_C(g_i) + N(0, σ²C²I))
/ B with designed per-sample gradients (``mechanism.py``); ``bug_zoo`` holds wrong steps seen
in real code, which the audit must flag, and ``bug_zoo_parts`` steps wrong in one layer,
parameter, record or call only; ``workbench_step`` runs the workbench's own optimizer.
``audit_canaries`` bounds ε from below with Dirac canaries in one run (``canary.py``; the
(ε, δ) bound of Steinke, Nasr, Jagielski 2023 is ``one_run_bound.py``): loose by design.
``audit_gaussian_step`` bounds one step's μ and ε tightly from many calls (Nasr et al. 2023,
``gaussian_audit.py``).
``audit_sampling`` tests that a data loader draws Poisson batches (``sampling.py``);
``audit_user_sampling`` that it draws Poisson *users*, all their records together
(``sampling_users.py``, user-level DP).
``audit_record_influence`` removes or replaces one record and compares the noiseless released
sums against C (``influence.py``; adapters for the engine, a naive step and a step factory in
``influence_steps.py``; losses and models that couple records in ``bug_zoo_coupling``).
``Claim`` states a privacy claim (``claim.py``, from YAML/JSON); ``audit_claim`` checks it
element by element (``claim_audit.py``; ``register_evidence`` adds evidence such as a
membership-inference attack on the trained model).
``membership_inference`` attacks trained models with shadow models (LiRA, Carlini et al. 2022)
and bounds ε from below by the attack's TPR and FPR (``membership.py``).
Every result is an ``AuditResult`` (``result.py``): ``passed``, ``table``, ``summary``, an HTML
repr; their plots are in ``workbench.viz``.
"""

# report_kinds, report_claim_kinds: the report's built-in kinds register themselves here,
# before any of this package's modules draws a report
from workbench.audit import (  # noqa: F401
    bug_zoo,
    bug_zoo_coupling,
    bug_zoo_parts,
    report_claim_kinds,
    report_kinds,
)
from workbench.audit.canary import CanaryAudit, audit_canaries
from workbench.audit.claim import Claim, ClaimError, load_claim
from workbench.audit.claim_audit import ClaimAudit, audit_claim, register_evidence
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.gaussian_audit import GaussianAudit, audit_gaussian_step
from workbench.audit.gradients import GradientAudit, audit_gradients
from workbench.audit.influence import InfluenceAudit, audit_record_influence
from workbench.audit.influence_steps import (
    engine_released_sum,
    naive_released_sum,
    step_released_sum,
)
from workbench.audit.mechanism import MechanismAudit, audit_dp_step
from workbench.audit.membership import MembershipAudit, membership_inference
from workbench.audit.one_run_bound import attainable_bound, epsilon_lower_bound
from workbench.audit.providers import (
    available_providers,
    opacus_provider,
    torch_func_provider,
)
from workbench.audit.result import AuditResult
from workbench.audit.sampling import SamplingAudit, audit_sampling
from workbench.audit.sampling_users import audit_user_sampling

__all__ = ["AuditResult", "CanaryAudit", "GaussianAudit", "GradientAudit", "MechanismAudit",
           "Claim", "ClaimAudit", "ClaimError", "InfluenceAudit", "audit_claim",
           "audit_record_influence", "bug_zoo_coupling", "engine_released_sum", "load_claim",
           "naive_released_sum", "register_evidence", "step_released_sum",
           "audit_canaries", "audit_dp_step", "audit_gaussian_step",
           "audit_gradients", "attainable_bound", "epsilon_lower_bound",
           "available_providers", "bug_zoo", "bug_zoo_parts", "opacus_provider",
           "torch_func_provider",
           "workbench_step", "SamplingAudit", "audit_sampling",
           "audit_user_sampling", "MembershipAudit",
           "membership_inference"]
