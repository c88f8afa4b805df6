"""Audit a privacy claim element by element: which evidence supports or refutes each one.

``audit_claim(claim, step=..., loader=...)`` gathers the evidence and returns a
:class:`ClaimAudit`: one row per element of the :class:`~workbench.audit.claim.Claim` with the
evidence, its finding and a verdict in ``VERDICTS``, plus the evidence's own results (report
sections). Evidence:

- the step (a ``--step`` factory, or the workbench's DPOptimizer when none is given): the
  mechanism audit at the claimed σ and C, the tight one-step audit (Nasr et al. 2023; at C' =
  1.5·C when the claimed C is 1, where σ and σ·C coincide and a step confusing them passes),
  and the record-influence audit (``influence.py``) for the neighbouring relation;
- the loader (``--loader``): the sampling audit (``sampling.py``) on min(N, 2000) indices at
  the claimed q, over 4 epochs or, when those cannot resolve a capped batch size, twins or
  one record drawn at ``RECORD_RATE`` q, over the epochs that can (at most ``LOADER_EPOCHS``
  and ``FULL_SIZE_CELLS`` memberships; beyond, the sampler is "inconclusive" where caps or
  twins stay unresolved, and the record rate it resolves is stated); a Poisson claim whose
  loader is not Poisson is refuted, and the ε is then judged by the shuffle bracket; a
  fixed-size claim whose loader passes as Poisson is refuted too (fixed-size batches fail
  the size test at any size), and the ε is then judged as Poisson's; where the audit is
  inconclusive, a fixed-size claim's ε must hold for Poisson batches and its own sampler
  both; a ``unit: user`` claim's loader is called as ``make_loader(dataset, user_ids)``
  (users of 1-3 records) and audited at the user level (``sampling_users.py``: users
  Poisson, each user's records together);
- the ε: recomputed by the claimed accountant (the deciding figure) and every other one at hand
  (``claim_epsilon.py``): supported at or above the deciding figure, inconclusive up to
  ``ROUNDING`` below it (unless below the proven lower bound), refuted beneath; for
  fixed-size batches the bracket of ``accounting.epsilon_bounds``;
- the trained model: evidence registered with ``register_evidence("trained model", fn)``,
  ``fn(claim, context) -> AuditResult`` with ``epsilon_lower`` (e.g. a membership-inference
  attack); it refutes the ε when its lower bound exceeds it.

A claim is never "supported" by an element no evidence checked: that row says "not checked"
and why; what only the claimant can know (pretraining) is "stated".
"""

from dataclasses import dataclass, field, replace

import pandas as pd
import torch

from workbench.audit.claim_epsilon import bracket, epsilon_figures
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.gaussian_audit import audit_gaussian_step
from workbench.audit.influence import RELATIONS, audit_record_influence, change_text
from workbench.audit.influence_steps import influence_pool, step_released_sum
from workbench.audit.mechanism import audit_dp_step
from workbench.audit.result import AuditResult
from workbench.audit.sampling import audit_sampling, repeats_in_a_pass
from workbench.audit.sampling_power import epochs_needed
from workbench.audit.sampling_users import audit_user_sampling, example_user_ids

SUPPORTED, REFUTED, INCONCLUSIVE, NOT_CHECKED, STATED = (
    "supported", "refuted", "inconclusive", "not checked", "stated")
VERDICTS = (SUPPORTED, REFUTED, INCONCLUSIVE, NOT_CHECKED, STATED)
ROUNDING = 0.01  # a claimed ε rounded down by up to 1% of the recomputed one: inconclusive
B_AUDIT, DIM, LOADER_N = 8, 32, 2000
B_CLAIMED = 512  # the mechanism audit also runs at the claim's batch size, up to this
FULL_SIZE_CELLS = 5e7  # the loader is also audited at the claimed N where N² / B fits
LOADER_SIGNIFICANCE = 1e-3  # the level a loader audit's rejection refutes a claim at, as
# the step audits' (at the audit's own 0.05 a correct Poisson loader refuted the claim in 2
# of 40 seeds until 2026-12-01); the audit runs at 0.05, its power stated there


def _rejected(result) -> bool:
    """The sampling audit rejected Poisson at ``LOADER_SIGNIFICANCE`` (Bonferroni over its
    rows, as its own verdict at its level)."""
    p = result.table["p-value"]
    return result.verdict != "inconclusive" and not result.passed \
        and bool((p < LOADER_SIGNIFICANCE / len(p)).any())
RECORD_RATE = 2.0  # the loader audit reruns to see one record drawn at this many times q
LOADER_EPOCHS = 200  # the most epochs the loader audit reruns with to resolve its deviations
EVIDENCE: dict = {}  # element -> [fn(claim, context) -> AuditResult | None]


def register_evidence(element: str, fn) -> None:
    """Add ``fn(claim, context) -> AuditResult`` as evidence for ``element`` ("trained model");
    ``context`` holds the step factory, loader and settings of the run."""
    EVIDENCE.setdefault(element, []).append(fn)


@dataclass
class ClaimAudit(AuditResult):
    """The claim, one row per element (``table``), and the evidence's results."""

    claim: object
    table: pd.DataFrame  # element, claimed, evidence, finding, verdict
    evidence: list = field(default_factory=list)  # [(title, AuditResult)]
    epsilons: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def passed(self) -> bool:
        return not (self.table["verdict"] == REFUTED).any()

    @property
    def summary(self) -> str:
        counts = self.table["verdict"].value_counts()
        parts = ", ".join(f"{int(counts[v])} {v}" for v in VERDICTS if v in counts)
        return f"claim {'REFUTED' if not self.passed else 'not refuted'}: {parts}"


def _row(element, claimed, evidence, finding, verdict):
    return {"element": element, "claimed": claimed, "evidence": evidence, "finding": finding,
            "verdict": verdict}


def _step_rows(claim, factory, name, trials, seed):
    C, sigma = claim.max_grad_norm, claim.noise_multiplier
    probe_C = C if abs(C - 1.0) > 0.2 else 1.5 * C
    gen = torch.Generator
    mech = audit_dp_step(factory(C, sigma, B_AUDIT, gen().manual_seed(seed + 1)), dim=DIM,
                         batch_size=B_AUDIT, max_grad_norm=C, noise_multiplier=sigma,
                         trials=trials, generator=gen().manual_seed(seed),
                         twin=factory(C, sigma, B_AUDIT, gen().manual_seed(seed + 2)))
    tight = audit_gaussian_step(factory(probe_C, sigma, B_AUDIT, gen().manual_seed(seed + 1)),
                                dim=1000, batch_size=B_AUDIT, max_grad_norm=probe_C,
                                noise_multiplier=sigma, delta=claim.delta, calls=200,
                                generator=gen().manual_seed(seed))
    G = influence_pool(B_AUDIT, DIM, C, gen().manual_seed(seed))
    influence = audit_record_influence(step_released_sum(factory, G, C, B_AUDIT), B_AUDIT,
                                       max_grad_norm=C, name=name)
    B = min(max(int(round(claim.expected_batch_size)), 1), B_CLAIMED)
    at_b = None if B == B_AUDIT else audit_dp_step(  # (a step right at B = 8 only, its
        # noise halved on a "large-batch path", was supported until 2026-12-01)
        factory(C, sigma, B, gen().manual_seed(seed + 3)), dim=DIM, batch_size=B,
        max_grad_norm=C, noise_multiplier=sigma, trials=trials,
        generator=gen().manual_seed(seed + 4),
        twin=factory(C, sigma, B, gen().manual_seed(seed + 5)))
    mechs = [mech] + ([at_b] if at_b is not None else [])
    ok = all(m.passed for m in mechs) and tight.passed
    unsure = not ok and tight.passed and all(m.passed or m.verdict == "inconclusive"
                                             for m in mechs)  # nothing failed, few trials
    sizes = f"B = {B_AUDIT}" + (f" and the claim's B = {B}" if at_b is not None else "")
    failed = next((m for m in mechs if not m.passed), None)
    rows = [_row("step: noise σ·C on the clipped sum", f"σ = {sigma:g}, C = {C:g}",
                 f"{name}: mechanism audit at {sizes} + tight one-step audit (at C = "
                 f"{probe_C:g})",
                 (failed.summary + (f" (at B = {B})" if failed is at_b else "")
                  if failed is not None else "mechanism matches"
                  + (f" ({mech.limits_text})" if mech.limits_text else ""))
                 + f"; {tight.summary}",
                 SUPPORTED if ok else INCONCLUSIVE if unsure else REFUTED)]
    rel = claim.neighbouring
    bound = RELATIONS[rel]
    worst = influence.worst(rel)
    held = bool(influence.table.loc[influence.table["relation"] == rel, "passed"].all())
    rows.append(_row("neighbouring relation", rel, f"{name}: record-influence audit",
                     f"largest change {change_text(worst, bound)} C (bound {bound:g} C; "
                     f"{influence.compared})", SUPPORTED if held else REFUTED))
    add_ok = bool(influence.table.loc[influence.table["relation"] == "add/remove",
                                      "passed"].all())
    unit = claim.unit  # "user": each row given to the step is one user's summed gradient
    over = change_text(influence.worst("add/remove"), 1.0)
    rows.append(_row("unit of privacy", unit, f"{name}: record-influence audit"
                     + (" (one row = one user's summed gradient)" if unit == "user" else ""),
                     f"each {unit}'s own clipped contribution" if add_ok else
                     f"removing one {unit} moves the released sum by {over} C, past C beyond "
                     f"the rounding of {influence.compared}: its own contribution is not "
                     f"clipped to C, or it moves other {unit}s' contributions",
                     SUPPORTED if add_ok else REFUTED))
    evidence = [(f"Claim · step: mechanism audit of {name}", mech)] + (
        [(f"Claim · step: mechanism audit of {name} at the claim's B = {B}", at_b)]
        if at_b is not None else []) + [
                (f"Claim · step: tight one-step audit of {name}", tight),
                (f"Claim · record influence of {name}", influence)]
    return rows, evidence


def _loader_row(claim, loader, seed):
    if loader is None:
        return _row("sampler", claim.sampler, "none", "pass --loader module:make_loader to "
                    "audit the data loader", NOT_CHECKED), None, claim.sampler
    N = min(claim.dataset_size, LOADER_N)
    if claim.q >= 1:  # every batch the whole set: nothing to test
        return _row("sampler", claim.sampler, "--loader", "q = 1: every batch holds every "
                    "record, whatever the sampler", INCONCLUSIVE), None, claim.sampler
    # at the claim's own q: capped at 0.5 until 2026-11-30, a correct Poisson loader at
    # q = 0.6 or 0.9 was refuted by the test's expectations for q = 0.5
    def audit(epochs):
        if claim.unit == "user":  # make_loader(dataset, user_ids): N users of 1-3 records each
            return audit_user_sampling(loader, example_user_ids(N, seed), claim.q,
                                       epochs=epochs)
        return audit_sampling(loader, N, claim.q, epochs=epochs)

    result = audit(4)
    # 4 epochs too few to resolve caps, twins or one record at RECORD_RATE q: the epochs that
    # do, where they fit (one record drawn at 3 q was supported until 2026-12-01: 4 epochs
    # see one only from about 4.7 q)
    per_epoch = max(1, round(result.steps / 4))
    need = None if result.verdict == "failed" else epochs_needed(
        N, claim.q, per_epoch, result.significance / len(result.table), RECORD_RATE)
    if need and need <= LOADER_EPOCHS and need * per_epoch * N <= FULL_SIZE_CELLS:
        result = audit(need)
    note, full = "", claim.dataset_size  # the loader at the claimed size too, two passes,
    # where that fits (a loader Poisson on small data sets only, fixed batches above, was
    # supported at N = 60000 from its 2000-index run until 2026-12-01)
    if claim.unit != "user" and full > N and full ** 2 / max(claim.expected_batch_size, 1) \
            <= FULL_SIZE_CELLS:
        at_full = audit_sampling(loader, full, claim.q, epochs=2)
        if _rejected(at_full):
            result, N = at_full, full
        else:
            note = (f"; at the claimed N = {full}, two passes: nothing rejected at "
                    f"{LOADER_SIGNIFICANCE:g}")
    summary = result.summary + note
    if not result.passed and result.verdict != "inconclusive" and not _rejected(result):
        summary += (f"; no test rejects at {LOADER_SIGNIFICANCE:g}, the level a claim is "
                    f"refuted at (a correct Poisson loader fails at 0.05 once in 20 runs)")
        return _row("sampler", claim.sampler, f"--loader: sampling audit on {N} indices",
                    summary, INCONCLUSIVE), result, (
                        claim.sampler if claim.sampler == "poisson"
                        else ("poisson", claim.sampler))
    if result.verdict == "inconclusive":  # nothing rejected, nothing resolved: the claim's
        # own sampler for its ε where it is Poisson; a fixed-size claim's batches would have
        # failed the size test, so its ε is judged by both (the worse decides)
        used = claim.sampler if claim.sampler == "poisson" else ("poisson", claim.sampler)
        return _row("sampler", claim.sampler, f"--loader: sampling audit on {N} indices",
                    summary, INCONCLUSIVE), result, used
    if result.passed:  # Poisson: the claim's if it says so
        verdict, used = (SUPPORTED, "poisson") if claim.sampler == "poisson" else \
            (REFUTED, "poisson")
        if claim.sampler != "poisson":  # (fixed-size batches fail the size test at any size;
            # a fixed-size claim on a Poisson loader was "inconclusive" and its ε judged by
            # the claim's bracket alone until 2026-12-01: at q = 0.5, σ = 1 the shuffle
            # bracket "supported" 4.4 where the loader's Poisson ε is at least 4.85)
            summary += (f"; the batch sizes vary as Poisson batches' do, so the batches are "
                        f"not the claimed {claim.sampler} fixed-size ones: the ε is judged "
                        f"as Poisson's")
        return _row("sampler", claim.sampler, f"--loader: sampling audit on {N} indices",
                    summary, verdict), result, used
    # not Poisson: fixed-size batches only if no pass draws a record twice; else no bracket
    if claim.unit == "user":  # a user's records in several batches of a pass is no repeat:
        # not checked, so no fixed-size bracket is supported (a weighted loader drawing
        # users ~30 times a pass was until 2026-11-30)
        summary += "; whether a pass draws a user twice is not checked for user-level loaders"
        verdict = REFUTED if claim.sampler == "poisson" else INCONCLUSIVE
        return _row("sampler", claim.sampler, f"--loader: sampling audit on {N} indices",
                    summary, verdict), result, None
    repeats = repeats_in_a_pass(loader, N)
    summary += f"; {repeats}" if repeats else "; no record twice in a pass"
    fixed = "shuffle" if claim.sampler == "poisson" else claim.sampler
    verdict = REFUTED if claim.sampler == "poisson" or repeats else SUPPORTED
    used = None if repeats else fixed
    return _row("sampler", claim.sampler, f"--loader: sampling audit on {N} indices",
                summary, verdict), result, used


def _epsilon_row(claim, sampler, figures):
    """The ε row for the loader's ``sampler``; for a tuple of samplers the evidence leaves
    possible, supported only where every one supports it, refuted only where every one
    refutes it."""
    if isinstance(sampler, tuple):
        rows = [_epsilon_row(claim, s, figures) for s in sampler]
        verdicts = {r["verdict"] for r in rows}
        verdict = verdicts.pop() if len(verdicts) == 1 else INCONCLUSIVE
        return _row("ε", rows[0]["claimed"], " and ".join(r["evidence"] for r in rows),
                    "the loader may be " + " or ".join(sampler) + ": " + "; ".join(
                        f"{s}: {r['finding']} ({r['verdict']})" for s, r in zip(sampler, rows)),
                    verdict)
    eps = claim.epsilon
    if sampler == "poisson":
        deciding = figures[(figures["source"] == "workbench") &
                           (figures["key"] == claim.accountant)]["epsilon"].iloc[0]
        if deciding is None or pd.isna(deciding):
            return _row("ε", f"{eps:g}", "recomputed", "the workbench's accountants are "
                        "add/remove; see the other libraries' figures", INCONCLUSIVE)
        finding = (f"ε = {deciding:.4g} for q = {claim.q:.4g}, σ = {claim.noise_multiplier:g}, "
                   f"{claim.total_steps * claim.tuning_runs} steps")
        if eps >= deciding:
            verdict = SUPPORTED
        elif eps >= deciding * (1 - ROUNDING):  # (a rounding, or a true claim: not proven.
            # "supported" until 2026-12-01, where 0.99 of the PLD figure is below a proven
            # lower bound on the true ε)
            low = bracket(claim, "poisson").lower
            verdict = REFUTED if eps < low else INCONCLUSIVE
            finding += (f"; the claim is {100 * (1 - eps / deciding):.2g}% below it (within "
                        f"the {100 * ROUNDING:g}% a claim may be rounded by, but not proven: "
                        f"the proven lower bound is {low:.4g}); state the ε rounded up")
        else:
            verdict = REFUTED
        return _row("ε", f"{eps:g} ({claim.accountant}, δ = {claim.delta:g})",
                    f"recomputed by the workbench's {claim.accountant}", finding, verdict)
    b = bracket(claim, sampler)
    why = ("" if sampler == claim.sampler else
           "the loader is not Poisson, so the Poisson ε does not apply; ")
    if claim.neighbouring == "substitution":  # one record replaced moves its batch's sum by
        # up to 2C: the bracket's upper bound (sensitivity C) at σ / 2; its lower bound (a
        # record replaced by one of zero gradient is a substitution) stands. The add/remove
        # bracket "supported" 4.89 for a true 11.0 until 2026-11-30
        doubled = bracket(claim, sampler, sensitivity=2.0)  # (deterministic batches: a
        b = doubled if sampler == "deterministic" else replace(b, upper=doubled.upper)
        # Gaussian mechanism per pass, exact at σ / 2 both ways)
        why += "substitution: sensitivity 2C, the upper bound at σ / 2; "
    verdict = REFUTED if eps < b.lower else SUPPORTED if eps >= b.upper else INCONCLUSIVE
    return _row("ε", f"{eps:g}", f"the {sampler} bracket (accounting.epsilon_bounds)",
                f"{why}{b.lower:.4g} <= ε <= {b.upper:.4g}", verdict)


def _trained_rows(claim, context):
    rows, evidence = [], []
    for fn in EVIDENCE.get("trained model", []):
        result = fn(claim, context)
        if result is None:
            continue
        low = float(getattr(result, "epsilon_lower", float("nan")))
        verdict = REFUTED if low > claim.epsilon else SUPPORTED
        rows.append(_row("trained model", f"ε = {claim.epsilon:g}", type(result).__name__,
                         f"attack's ε lower bound {low:.3g}", verdict))
        evidence.append(("Claim · trained model: " + type(result).__name__, result))
    if not rows:
        rows.append(_row("trained model", f"ε = {claim.epsilon:g}", "none",
                         "no membership-inference audit registered for this run", NOT_CHECKED))
    return rows, evidence


def audit_claim(claim, *, step=None, step_name: str = "", loader=None, trials: int = 200,
                seed: int = 0) -> ClaimAudit:
    """Check ``claim`` against the step (``step(C, σ, B, generator) -> step_fn``, default the
    workbench's DPOptimizer), the ``loader`` (``make_loader(dataset)``; for ``unit: user``
    ``make_loader(dataset, user_ids)``, audited by ``audit_user_sampling``) and the
    accountants."""
    factory = step or workbench_step
    name = step_name or ("your step" if step else "the workbench's DPOptimizer")
    rows, evidence = _step_rows(claim, factory, name, trials, seed)
    loader_row, sampling, sampler = _loader_row(claim, loader, seed)
    rows.insert(0, loader_row)
    if sampling is not None:
        evidence.append(("Claim · sampler: sampling audit of --loader", sampling))
    figures = epsilon_figures(claim)
    if sampler is None:  # the loader draws a record twice a pass, or may (_loader_row):
        rows.append(_row("ε", f"{claim.epsilon:g}", "none", "the loader may draw a record "
                         "(a user) more than once a pass, so no fixed-size bracket applies",
                         INCONCLUSIVE))
    else:
        rows.append(_epsilon_row(claim, sampler, figures))
    rows.append(_row("δ", f"{claim.delta:g}", "dataset_size",
                     f"δ < 1/N = {1 / claim.dataset_size:.3g}", SUPPORTED))
    runs = claim.tuning_runs
    rows.append(_row("covers: tuning runs", str(runs), "the ε above",
                     f"ε recomputed for {runs} run(s) of {claim.total_steps} steps", STATED))
    rows.append(_row("covers: pretraining", claim.covers["pretraining"], "none",
                     "only the claimant can state what pretraining used", STATED))
    trained, more = _trained_rows(claim, {"step": factory, "loader": loader, "seed": seed})
    order = ["unit of privacy", "neighbouring relation", "sampler"]
    rows.sort(key=lambda r: order.index(r["element"]) if r["element"] in order else 3)
    return ClaimAudit(claim, pd.DataFrame(rows + trained), evidence + more, figures)


__all__ = ["EVIDENCE", "ROUNDING", "VERDICTS", "ClaimAudit", "audit_claim", "register_evidence"]
