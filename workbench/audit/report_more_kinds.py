"""Report kinds for the sampling audit and the tight Gaussian-step audit, and their sections.

Each result brings its own ``.table`` and ``.summary``; a kind adds the two sentences of what
and why, and the figure. ``privacy_extras`` builds the sections the headless job runs: the
workbench's Poisson loader must pass the sampling audit, a shuffled fixed-size loader must be
caught; the workbench's optimizer step must pass the tight Gaussian audit, a step with half
the claimed noise must be caught.
"""

import pandas as pd
import torch
from torch.utils.data import DataLoader

from workbench.audit.bug_zoo import correct_step
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.gaussian_audit import audit_gaussian_step
from workbench.audit.report import SELF_CHECK, SUBJECT, Kind, register_kind, section
from workbench.audit.sampling import audit_sampling
from workbench.dpsgd.sampling import DPDataLoader
from workbench.viz.audit_membership import plot_membership_roc
from workbench.viz.audit_privacy import plot_gaussian_scores

SAMPLING = dict(dataset_size=1000, sample_rate=0.05, epochs=4)
GAUSSIAN = dict(dim=1000, batch_size=8, max_grad_norm=1.5, noise_multiplier=2.0, calls=200)


register_kind("SamplingAudit", Kind(
    what="The loader under test draws batches from a data set whose items are their own "
         "indices, for several epochs; batch sizes and their extremes, per-example counts, "
         "the overlap of batches and how often any two records meet must look like Poisson "
         "sampling, and the run must be large enough to see a capped batch size or records "
         "drawn in pairs (else: inconclusive). The accountant's amplification by sampling "
         "holds only for Poisson batches; shuffled fixed-size batches are the most common "
         "accounting error in deployed DP-SGD (Chua et al., ICML 2024).",
    summary=lambda r: (r.summary, f"smallest p-value {r.table['p-value'].min():.3g}")))

register_kind("GaussianAudit", Kind(
    what="Many calls of the step on a gradient that is present or absent, scored by the "
         "white-box test of Nasr et al. 2023: a tight lower bound on one step's ε, compared "
         "with the accountant's claim. Unlike the one-run canary bound, it reaches the claim "
         "for a correct step, so a step with less noise than claimed fails.",
    summary=lambda r: (r.summary, f"ε_lower {r.table['epsilon_lower'].iloc[0]:.3g} vs "
                                  f"{r.table['epsilon_upper'].iloc[0]:.3g}"),
    figures=(plot_gaussian_scores,)))


def privacy_extras(seed: int = 0, own_part: str = SUBJECT) -> list:
    """The sampling and tight Gaussian sections of the headless audit; the workbench's own
    loader and step are ``own_part``, the bugs that must be caught are self-checks."""
    def poisson(dataset):
        return DPDataLoader(dataset, sample_rate=SAMPLING["sample_rate"],
                            generator=torch.Generator().manual_seed(seed))

    def shuffled(dataset):
        return DataLoader(dataset, batch_size=round(SAMPLING["sample_rate"] * len(dataset)),
                          shuffle=True, generator=torch.Generator().manual_seed(seed))

    out = [section("Sampling: the workbench's Poisson loader", audit_sampling(poisson,
                                                                               **SAMPLING),
                   part=own_part),
           section("Sampling: a shuffled fixed-size loader must be caught",
                   audit_sampling(shuffled, **SAMPLING), expect_failure=True, part=SELF_CHECK)]
    C, sigma, B = GAUSSIAN["max_grad_norm"], GAUSSIAN["noise_multiplier"], GAUSSIAN["batch_size"]
    ours = workbench_step(C, sigma, B, torch.Generator().manual_seed(seed + 1))
    out.append(section("Tight audit of one step: workbench DP optimizer", audit_gaussian_step(
        ours, generator=torch.Generator().manual_seed(seed), **GAUSSIAN), part=own_part))
    leaky = correct_step(C, sigma / 2, B, torch.Generator().manual_seed(seed + 1))  # σ/2 noise
    out.append(section("Tight audit of one step: half the claimed noise must be caught",
                       audit_gaussian_step(leaky, generator=torch.Generator().manual_seed(seed),
                                           **GAUSSIAN), expect_failure=True,
                       part=SELF_CHECK))
    return out


# --- membership inference on trained models (workbench.audit.membership) --------------------

def membership_table(result):
    """(one row of the attack's numbers for people, the notes stated once)."""
    r = result.table.iloc[0]
    rows = [result] + ([result.reference] if result.reference is not None else [])
    table = pd.DataFrame([{
        "models": x.label, "AUC": f"{x.auc:.3f}", "TPR at FPR 1e-3": f"{x.tpr_at[1e-3]:.3g}",
        "TPR at FPR 1e-2": f"{x.tpr_at[1e-2]:.3g}",
        "ε_lower (attack)": f"{x.epsilon_lower:.3g}",
        "ε interval": f"[{x.epsilon_interval[0]:.3g}, {x.epsilon_interval[1]:.3g}]",
        "ε_lower (one-run)": f"{x.epsilon_lower_one_run:.3g}",
        "ε claimed (accountant)": f"{x.epsilon_claimed:.3g}", "passed": x.passed} for x in rows])
    return table, [
        f"{r['attack']} with {r['shadows']} shadow models on a pool of {r['pool']} "
        f"records; {r['targets']} held-out target models give {r['members'] + r['non_members']} "
        f"(record, model) trials. ε_lower holds at confidence {r['confidence']:g} (δ = "
        f"{r['delta']:g}; Clopper-Pearson limits on TPR and FPR at a threshold chosen on the "
        f"shadows); the interval is its two-sided mirror. The one-run ε_lower (Steinke, Nasr, "
        f"Jagielski 2023, Thm. 3.1) is sound although one model's trials share its training."]


register_kind("MembershipAudit", Kind(
    what="Shadow models trained on random halves of a pool of records teach a likelihood-ratio "
         "attack (LiRA, Carlini et al. 2022) what each record's confidence looks like when it "
         "was trained on and when not; held-out target models are then attacked. The attack's "
         "true- and false-positive rates imply a lower bound on ε, which must not exceed what "
         "the accountant claims; the non-private twin shows what the attack finds without DP.",
    summary=lambda r: (r.summary.split(": ", 1)[-1],
                       f"TPR {r.tpr_at[1e-3]:.2g} at FPR 1e-3, ε_lower {r.epsilon_lower:.2g}"),
    table=membership_table, figures=(plot_membership_roc,), figsize=(6.4, 4.2)))


__all__ = ["GAUSSIAN", "SAMPLING", "membership_table", "privacy_extras"]
