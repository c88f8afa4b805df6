"""Membership inference on trained models (LiRA with shadow models), and the ε it implies.

N. Carlini, S. Chien, M. Nasr, S. Song, A. Terzis, F. Tramèr (2022), "Membership Inference
Attacks From First Principles", IEEE S&P, arXiv 2112.03570: the Likelihood Ratio Attack,
Algorithm 1 (online) and Sec. VI-C (offline); the scores, the ROC and the ε bound are in
``membership_stats.py``, the models and their training in ``membership_train.py``.

The experiment, for one ``Recipe`` (the same for every model, DP or not):

1. S **shadow** models, each trained on a random half of a pool of N records; the design is
   balanced (record i is IN for exactly S/2 shadows), so every record has IN and OUT fits.
2. K **target** models, held out from the shadows, each trained on the records of an
   independent Bernoulli(½) mask: record i's membership in target k is a fair coin, independent
   of everything the attacker sees except target k itself (this is what (HT) needs).
3. Every record of every target is scored with the Gaussians fitted on all S shadows: the K·N
   (score, membership) pairs give the ROC, AUC and TPR at FPR 10⁻³ and 10⁻².
4. The threshold τ for the ε bound is chosen on the shadows only (each shadow scored by the
   other S − 1), so it does not depend on the targets' counts; at that τ the targets' counts
   give ε_lower with Clopper-Pearson limits, compared with the accountant's ε for the targets.

``passed``: ε_lower ≤ ε_claimed (the accountant's ε; inf for a non-private recipe).
What the bound cannot say: trials of one target share its training run. The targets are
independent of each other and each record's coin is independent of the rest, but the K·N
trials are not K·N independent runs; the binomial limits treat them as such, the usual
practice of per-record MIA audits. The table's ``epsilon_lower_one_run`` is sound under this
dependence (Steinke, Nasr, Jagielski 2023, arXiv 2305.08846, Thm. 3.1, with top/bottom
guesses at a fraction chosen on the shadows; ``membership_stats.one_run_bound``), and looser.
How many shadows: LiRA's Fig. 9 shows the online attack near its best from 16 shadows with the
global variance, and the offline attack usable from 4; K·N ≥ 2000 trials make FPR 10⁻³ one
false positive, the least at which "TPR at FPR 10⁻³" means anything.

Notation: S shadows, K targets, N pool size, τ threshold, β = 1 − confidence.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from workbench.audit import membership_stats as ms
from workbench.audit.membership_train import (
    Recipe,
    Task,
    digits_task,
    gpt_task,
    score_pool,
    train_model,
)
from workbench.audit.result import AuditResult
from workbench.checks import check_count, check_delta, check_probability

FPRS = (1e-3, 1e-2)
TASKS = {"digits": digits_task, "tiny_gpt": gpt_task}


@dataclass
class MembershipAudit(AuditResult):
    """An attack's ROC, TPR at low FPR, per-record risk and ε_lower vs the accountant's ε."""

    label: str  # "DP-SGD σ=..., ..." or "non-private, ..."
    fpr: np.ndarray = field(repr=False)  # ROC over the targets' K·N trials
    tpr: np.ndarray = field(repr=False)
    auc: float
    tpr_at: dict  # {FPR: TPR}
    epsilon_lower: float
    epsilon_estimate: float
    epsilon_interval: tuple  # (ε_lower, mirrored upper end), level 1 − 2β
    epsilon_claimed: float  # the accountant's ε for the targets; inf when not private
    table: pd.DataFrame
    scores: np.ndarray = field(repr=False)  # (K, N) Λ of each target's records
    members: np.ndarray = field(repr=False)  # (K, N) bool, the targets' masks
    risk: np.ndarray = field(repr=False)  # (N,) |μ_in − μ_out| / σ_out per record
    reference: "MembershipAudit | None" = field(default=None, repr=False)  # e.g. non-DP twin
    skipped: bool = False
    reason: str = ""

    @property
    def passed(self) -> bool:
        return not self.skipped and bool(self.epsilon_lower <= self.epsilon_claimed)

    @property
    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"Membership inference ({self.label}) {verdict}: AUC {self.auc:.3f}, TPR "
                f"{self.tpr_at[1e-3]:.3g} at FPR 1e-3; ε_lower {self.epsilon_lower:.3g} vs "
                f"claimed {self.epsilon_claimed:.3g}")

    @property
    def epsilon_lower_one_run(self) -> float:
        """ε_lower of the one-run theorem: sound although a target's trials share its run."""
        return float(self.table["epsilon_lower_one_run"].iloc[0])

    def risk_table(self, top: int = 10) -> pd.DataFrame:
        """The ``top`` records whose confidence moves most when they are trained on."""
        order = np.argsort(-self.risk)[:top]
        return pd.DataFrame({"record": order, "risk": self.risk[order]})

    def plot(self, ax):
        """``workbench.viz.audit_membership.plot_membership_roc``; artists."""
        from workbench.viz.audit_membership import plot_membership_roc

        return plot_membership_roc(ax, self)


def shadow_masks(S: int, N: int, rng: np.random.Generator) -> np.ndarray:
    """(S, N) bool, each column with exactly S/2 True: record i IN for half the shadows."""
    return np.argsort(rng.random((S, N)), axis=0) < S // 2


def calibration_scores(phi: np.ndarray, masks: np.ndarray, attack: str, variance: str):
    """Each shadow's records scored by Gaussians fitted on the other S − 1: (S, N)."""
    S = len(phi)
    keep = [np.arange(S) != s for s in range(S)]
    return np.stack([ms.lira_scores(phi[s], ms.fit_gaussians(phi[k], masks[k], variance), attack)
                     for s, k in zip(range(S), keep)])


def _train_all(task, masks, recipe, seeds, desc, progress):
    phi, eps = [], []
    for m, seed in tqdm(list(zip(masks, seeds)), desc=desc, disable=not progress, leave=False):
        model, e = train_model(task, m, recipe, int(seed))
        phi.append(score_pool(task, model))
        eps.append(e)
    return np.stack(phi), eps  # (models, N)


def membership_inference(task="digits", recipe: Recipe | None = None, *, shadows: int = 16,
                         targets: int = 4, attack: str = "online", variance: str = "global",
                         confidence: float = 0.95, seed: int = 0, progress: bool = True,
                         reference: Recipe | None = None, **task_options) -> MembershipAudit:
    """LiRA on ``targets`` models trained with ``recipe``, using ``shadows`` shadow models.

    ``task``: "digits" (``digits_task``), "tiny_gpt" (``gpt_task``) or a ``Task``;
    ``task_options`` go to the task factory (``pool_size=``, ...). ``reference``: a second
    recipe (e.g. the same without DP) attacked the same way and kept as ``.reference``, so
    the ROC figure shows both. ``seed`` fixes masks, initialisations, batches and noise.
    """
    recipe = Recipe() if recipe is None else recipe
    if isinstance(task, str):
        if task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)} or a Task; got {task!r}")
        task = TASKS[task](seed=seed, **task_options)
    elif not isinstance(task, Task) or task_options:
        raise TypeError("pass a Task, or a task name with its options (pool_size=...)")
    S = check_count(shadows, "shadows", 4, note="an even number, half IN for every record")
    if S % 2:
        raise ValueError(f"shadows must be even (each record IN for exactly half); got {S}")
    K = check_count(targets, "targets", 1)
    check_probability(confidence, "confidence", note="e.g. 0.95")
    delta = check_delta(recipe.delta)
    rng = np.random.default_rng(seed)
    N = len(task.pool)
    s_masks, t_masks = shadow_masks(S, N, rng), rng.random((K, N)) < 0.5  # Bernoulli(½)
    if not t_masks.any(axis=1).all():
        raise ValueError("a target drew no IN record; use a larger pool_size")
    seeds = rng.integers(2 ** 62, size=S + K)
    what = f"{task.name}, {recipe.describe()}"
    phi_s, _ = _train_all(task, s_masks, recipe, seeds[:S], f"shadows ({what})", progress)
    phi_t, eps = _train_all(task, t_masks, recipe, seeds[S:], f"targets ({what})", progress)
    fit = ms.fit_gaussians(phi_s, s_masks, variance)
    scores = ms.lira_scores(phi_t, fit, attack)  # (K, N)
    calibration = calibration_scores(phi_s, s_masks, attack, variance)  # (S, N)
    tau = ms.choose_threshold(calibration, s_masks, delta, confidence)
    bound = ms.epsilon_bounds_at(scores, t_masks, tau, delta, confidence)
    fraction = ms.choose_fraction(calibration, s_masks, delta, confidence)
    one_run = ms.one_run_bound(scores, t_masks, fraction, delta, confidence)
    fpr, tpr = ms.roc_curve(scores, t_masks)
    risk = np.abs(fit["mu_in"] - fit["mu_out"]) / fit["sd_out"]
    claimed = max(eps) if recipe.private else math.inf
    row = {"task": task.name, "recipe": recipe.describe(), "attack": f"LiRA {attack}",
           "shadows": S, "targets": K, "pool": N, "auc": ms.auc(fpr, tpr),
           **{f"tpr_at_fpr_{a:g}": ms.tpr_at_fpr(fpr, tpr, a) for a in FPRS}, **bound, **one_run,
           "epsilon_claimed": claimed, "delta": delta, "confidence": confidence}
    row["passed"] = bool(bound["epsilon_lower"] <= claimed)
    ref = None
    if reference is not None:
        ref = membership_inference(task, reference, shadows=S, targets=K, attack=attack,
                                   variance=variance, confidence=confidence, seed=seed,
                                   progress=progress)
    return MembershipAudit(
        recipe.describe(), fpr, tpr, row["auc"], {a: row[f"tpr_at_fpr_{a:g}"] for a in FPRS},
        bound["epsilon_lower"], bound["epsilon_estimate"],
        (bound["epsilon_lower"], bound["epsilon_upper_end"]), claimed, pd.DataFrame([row]),
        scores, t_masks, risk, ref)


# The audit's settings (report and notebook 06). 16 shadows: LiRA's online attack with the
# global variance is near its best there (Carlini et al. 2022, Fig. 9); 4 targets on a pool
# of 500 give ~2000 trials, so FPR 1e-3 is resolved. --quick halves shadows and targets and
# keeps the pool, so q = B / (N/2) and the claimed ε stay those of the full audit.
SETTINGS = {"full": dict(shadows=16, targets=4, pool_size=500),
            "quick": dict(shadows=8, targets=2, pool_size=500)}
DP_RECIPE = Recipe(epochs=15, batch_size=50, lr=0.2, noise_multiplier=2.0)  # ε ≈ 4.7 at 1e-5
NON_DP_RECIPE = Recipe(epochs=40, batch_size=50, lr=0.01, optimizer="adam")  # overfits


def audit_digits(quick: bool = False, seed: int = 0, progress: bool = True) -> MembershipAudit:
    """LiRA on the digits MLP trained with ``DP_RECIPE``, its non-private twin as reference."""
    size = SETTINGS["quick" if quick else "full"]
    return membership_inference("digits", DP_RECIPE, reference=NON_DP_RECIPE, seed=seed,
                                progress=progress, **size)


def report_section(quick: bool = False, seed: int = 0, progress: bool = True, part=None):
    """The report section of ``audit_digits`` (registers the kind: ``report_more_kinds``);
    ``part``: where the report puts it (``report.SUBJECT`` by default)."""
    import workbench.audit.report_more_kinds  # noqa: F401  (the MembershipAudit kind)
    from workbench.audit.report import section

    extra = {} if part is None else {"part": part}
    return section("Membership inference on a trained model: digits MLP, DP vs non-DP",
                   audit_digits(quick, seed, progress), **extra)


__all__ = [
    "DP_RECIPE", "FPRS", "NON_DP_RECIPE", "SETTINGS", "TASKS", "MembershipAudit", "audit_digits",
    "calibration_scores", "membership_inference", "report_section", "shadow_masks",
]
