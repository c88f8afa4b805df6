"""The headless audit's suite: which audits run, in which order, into which report sections.

1. per-sample gradients of the workbench's methods against micro-batching (model zoo and the
   digits CNN on digits data, or the user's --model/--data); a --provider likewise;
2. other libraries (Opacus modes, BackPACK) the same way: informational, SKIPPED with the
   reason when not installed;
3. the workbench's DP step (and a --step): mechanism audit, σ = 0 clipping check, canary audit
   (a --step also the tight one-step audit);
   the correct reference step; the bug zoo, every wrong step of which must be caught; a
   no-noise step, whose canary bound must exceed the accountant's ε;
4. the sampling audit (the Poisson loader passes, a shuffled loader is caught) and the tight
   audit of one Gaussian step (the correct step passes, half the noise is caught);
5. every registered accountant side by side (RDP and PLD built in), and dp-accounting's and
   Opacus' accountants beside them when installed (informational);
6. record influence (``influence.py``): the engine on a model (or --model with --loss), each
   --step, and a naive step on each coupled loss of ``bug_zoo_coupling``, which must be caught.

Each section has a part: the subject (the user's code when given, else the workbench), the
tool's self-checks (bugs it must catch, the reference step), other libraries.

Every seed is in ``SEEDS`` and every setting in ``settings(args)``, both copied into the
report's provenance.
"""

import torch
from tqdm.auto import tqdm

from workbench import data, models
from workbench.audit import bug_zoo, bug_zoo_parts, membership
from workbench.audit.canary import audit_canaries
from workbench.audit.claim_epsilon import compare_libraries
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.gaussian_audit import audit_gaussian_step
from workbench.audit.gradients import audit_gradients
from workbench.audit.mechanism import audit_dp_step
from workbench.audit.providers import available_providers
from workbench.audit.report import LIBRARY, SELF_CHECK, SUBJECT, Skipped, section
from workbench.audit.report_kinds import LIBRARY_WHAT
from workbench.audit.report_more_kinds import GAUSSIAN, privacy_extras
from workbench.audit.report_suites import (
    BugZooSuite,
    GradientSuite,
    check_accountants,
    check_clipping,
)
from workbench.audit.result import Crashed
from workbench.errors import NonFiniteStepError
from workbench.methods import CLIP_METHODS

METHODS = tuple(m for m in CLIP_METHODS if m != "microbatch")  # each against microbatch
C, SIGMA, B, DIM = 1.5, 0.7, 8, 32  # mechanism audit; C != 1 so that σ vs σC shows, σ != 1
# so that σ² or √σ (a variance taken for a std) shows: they equal σ only at σ = 1
CANARY = dict(dim=1000, steps=10, sample_rate=0.5, noise_multiplier=4.0)
SEEDS = {"model_init": 0, "zoo_batch": 0, "mechanism_design": 0, "step_noise": 1, "canary": 0,
         "clipping_design": 0, "sampling": 0, "membership": 0, "twin_noise": 2}


def built(factory, C, sigma, B, seed_name="step_noise"):
    """``factory(C, σ, B, generator)`` with the generator of ``SEEDS[seed_name]``; the twin the
    mechanism audit compares it with is the same call with "twin_noise"."""
    return factory(C, sigma, B, torch.Generator().manual_seed(SEEDS[seed_name]))


def settings(args) -> dict:
    return {**{k: (str(v) if v is not None else None) for k, v in vars(args).items()},
            "max_grad_norm": C, "noise_multiplier": SIGMA, "batch_size": B, "dim": DIM,
            "canary": str(CANARY), "gradient_methods": ", ".join(METHODS),
            "accountant_settings": str(accountant_settings(args.quick))}


def accountant_settings(quick: bool):
    first = (256 / 60000, 1.1, 10_000)
    return [first] if quick else [first, (0.01, 0.8, 1_000), (0.1, 2.0, 500), (1.0, 5.0, 10)]


def zoo_cases(quick: bool):
    """(name, model, inputs, targets): zoo models on example batches, the digits CNN on data."""
    n, cases = (2 if quick else 4), []
    for name in (["digits_mlp", "imdb_embedding"] if quick else list(models.ZOO)):
        torch.manual_seed(SEEDS["model_init"])
        x, y = models.example_batch(name, n,
                                    generator=torch.Generator().manual_seed(SEEDS["zoo_batch"]))
        if x.dtype == torch.int64:
            x = x[:, :16].clone()  # shorter sequences: the micro-batching reference stays quick
            x[:, 8:12] = x[0, :4]  # tokens repeated in a record and shared by records: an
            # embedding's rows must sum within a record and stay apart across them (random
            # tokens from 10,004 never repeat, and two wrong providers passed until 2026-12-01)
        cases.append((name, models.make_model(name), x, y))
    train, _ = data.load_digits()
    torch.manual_seed(SEEDS["model_init"])
    cases.append(("digits_cnn on digits", models.digits_cnn(), train.tensors[0][:n],
                  train.tensors[1][:n]))
    return cases


def gradient_sections(cases, loss_fn, user_providers: dict, progress: bool,
                      own_part: str = SUBJECT) -> list:
    found, missing = available_providers()
    libraries = {k: v for k, v in found.items() if k != "torch_func"}
    providers = {**libraries, **user_providers}
    audits, out = {}, []
    for name, model, x, y in tqdm(cases, desc="gradient audit", disable=not progress):
        try:
            audits[name] = audit_gradients(model, loss_fn, x, y, methods=METHODS,
                                           providers=providers)
        except Exception as err:  # noqa: BLE001  (the reference itself cannot run on it)
            out.append(section(f"Per-sample gradients: {name}", Skipped(
                f"micro-batching, the reference, cannot run on it ({type(err).__name__}: "
                f"{err})")))
    if audits:
        out.insert(0, section("Per-sample gradients: workbench methods vs micro-batching",
                              GradientSuite(audits, METHODS), part=own_part))
        for spec in user_providers:
            out.append(section(f"Per-sample gradients: your provider {spec} vs micro-batching",
                               GradientSuite(audits, (spec,), LIBRARY_WHAT)))
        for lib in libraries:
            out.append(section(f"Other libraries: {lib} vs micro-batching",
                               GradientSuite(audits, (lib,), LIBRARY_WHAT, library=True),
                               must_pass=False))
    for lib, reason in missing.items():
        out.append(section(f"Other libraries: {lib} vs micro-batching", Skipped(reason),
                           must_pass=False))
    return out


def _guarded(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001  (the step under audit failed: a finding)
        return Crashed(err)


def _finite(factory, name: str):
    """``factory`` whose step_fn refuses to return a non-finite update (NaN, inf): the audit
    section then fails with that finding instead of crashing in a statistic or a figure."""
    def checked_factory(*args, **kwargs):
        step = factory(*args, **kwargs)

        def checked_step(G):
            out = step(G)
            if isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
                bad = int((~torch.isfinite(out)).sum())
                raise NonFiniteStepError(
                    f"{name}'s step_fn returned {bad} non-finite value(s) (NaN or inf) of "
                    f"{out.numel()} for G of shape {tuple(G.shape)} with finite entries; a DP "
                    f"step must return a finite update (check its clipping's division by "
                    f"the norm, and its noise)")
            return out

        return checked_step

    return checked_factory


def step_sections(name: str, factory, trials: int, part: str = SUBJECT) -> list:
    factory = _finite(factory, name)
    mech = _guarded(audit_dp_step, built(factory, C, SIGMA, B), dim=DIM, batch_size=B,
                    max_grad_norm=C, noise_multiplier=SIGMA, trials=trials,
                    generator=torch.Generator().manual_seed(SEEDS["mechanism_design"]),
                    twin=built(factory, C, SIGMA, B, "twin_noise"))
    clip = _guarded(check_clipping, factory, C, B, DIM,
                    torch.Generator().manual_seed(SEEDS["clipping_design"]))
    canary = _guarded(audit_canaries, factory, **CANARY, max_grad_norm=C,
                      generator=torch.Generator().manual_seed(SEEDS["canary"]))
    return [section(f"DP step: {name}", mech, part=part),
            section(f"Clipping: {name} with σ = 0", clip, part=part),
            section(f"Canary audit: {name} (ε from below)", canary, part=part)]


def user_step_sections(spec: str, factory, trials: int) -> list:
    """A --step: mechanism, clipping, canary, and the tight one-step audit (the only one that
    catches noise σ instead of σ·C at C != 1)."""
    tight = _guarded(audit_gaussian_step, factory(GAUSSIAN["max_grad_norm"],
                     GAUSSIAN["noise_multiplier"], GAUSSIAN["batch_size"],
                     torch.Generator().manual_seed(SEEDS["step_noise"])),
                     generator=torch.Generator().manual_seed(SEEDS["sampling"]), **GAUSSIAN)
    return step_sections(f"your step {spec}", factory, trials) + [
        section(f"Tight audit of one step: your step {spec}", tight)]


def privacy_sections(args, user_steps: dict, progress: bool, own_part: str = SUBJECT) -> list:
    out = step_sections("workbench DP optimizer", workbench_step, args.trials, own_part)
    for spec, factory in user_steps.items():
        out += user_step_sections(spec, factory, args.trials)
    correct = bug_zoo.ZOO[bug_zoo.CORRECT]
    out.append(section("DP step: correct reference step (bug_zoo.correct_step)", audit_dp_step(
        built(correct, C, SIGMA, B), dim=DIM, batch_size=B, max_grad_norm=C,
        noise_multiplier=SIGMA, trials=args.trials,
        generator=torch.Generator().manual_seed(SEEDS["mechanism_design"]),
        twin=built(correct, C, SIGMA, B, "twin_noise")), part=SELF_CHECK))
    bugs = {**{k: f for k, f in bug_zoo.ZOO.items() if k != bug_zoo.CORRECT},
            **bug_zoo_parts.PARTS}
    audits = {}
    for name in tqdm(bugs, desc="bug zoo", disable=not progress):
        audits[name] = audit_dp_step(built(bugs[name], C, SIGMA, B), dim=DIM, batch_size=B,
                                     max_grad_norm=C, noise_multiplier=SIGMA,
                                     trials=args.trials, generator=torch.Generator().manual_seed(
                                         SEEDS["mechanism_design"]),
                                     twin=built(bugs[name], C, SIGMA, B, "twin_noise"))
    docs = {k: " ".join((f.__doc__ or "").split("\n\n")[0].split()).removeprefix("Bug: ")
            for k, f in bugs.items()}  # the docstring's first paragraph, on one line
    out.append(section("DP step: bug zoo, each wrong step must be caught",
                       BugZooSuite(audits, docs), part=SELF_CHECK))
    leak = audit_canaries(bug_zoo.no_noise, **CANARY, max_grad_norm=C,
                          generator=torch.Generator().manual_seed(SEEDS["canary"]))
    out.append(section("Canary audit: a step without noise must be caught", leak,
                       expect_failure=True, part=SELF_CHECK))
    out += privacy_extras(SEEDS["sampling"], own_part)
    out.append(membership.report_section(args.quick, SEEDS["membership"], progress, own_part))
    check = check_accountants(accountant_settings(args.quick))
    out.append(section("Accountants: " + " vs ".join(check.labels.values()), check,
                       part=own_part))
    others = compare_libraries(*accountant_settings(args.quick)[0], check.delta)
    out.append(section("Other libraries: dp-accounting and Opacus accountants vs the workbench",
                       others if len(others) else Skipped(
                           "neither dp-accounting nor Opacus is installed (pip install "
                           "dp-accounting opacus)"), must_pass=False, part=LIBRARY))
    return out


def influence_case(args, cases):
    """(name, model, inputs, targets) of 9 records for the record-influence audit: the user's
    --model/--data, else the zoo's digits_mlp on an example batch."""
    if args.model:
        return cases[0]
    torch.manual_seed(SEEDS["model_init"])
    x, y = models.example_batch("digits_mlp", 9,
                                generator=torch.Generator().manual_seed(SEEDS["zoo_batch"]))
    return "digits_mlp", models.make_model("digits_mlp"), x, y


__all__ = [
    "CANARY", "METHODS", "SEEDS", "NonFiniteStepError", "accountant_settings", "built",
    "gradient_sections", "influence_case", "privacy_sections", "settings", "step_sections",
    "user_step_sections", "zoo_cases",
]
