"""The headless main job: ``python -m workbench audit`` (also ``make audit``).

Audits per-sample gradients, the DP step, clipping, canaries, the accountants and record
influence (the suite is in ``cli_suite.py``), and a privacy claim element by element
(``--claim``, ``claim_audit.py``), and writes report.html (for people) and report.json (for
machines, with a JSON Schema) to --out.

Exit codes: 0 every check the workbench (and your code) must pass passed; 1 the audit found a
failure; 2 usage or input error (a one-line message naming the option, no traceback). Skipped
sections (e.g. a library not installed) never count as passed, and never fail the run.
"""

import argparse
import sys
import time
from pathlib import Path

from torch import nn

from workbench.audit import cli_suite
from workbench.audit.claim import load_claim
from workbench.audit.claim_audit import audit_claim
from workbench.audit.cli_inputs import (
    InputError,
    check_out,
    load_callable,
    user_case,
    user_provider,
    user_step,
)
from workbench.audit.report import PARTS, SELF_CHECK, SUBJECT, section
from workbench.audit.report_claim_kinds import influence_sections
from workbench.audit.report_files import write_report
from workbench.audit.report_provenance import provenance
from workbench.models import sequence_cross_entropy

LOSSES = {"cross_entropy": nn.CrossEntropyLoss(reduction="none"),
          "mse": lambda out, y: ((out - y) ** 2).reshape(len(out), -1).sum(1),
          # language models: logits (n, T, V), targets (n, T), summed over the T tokens
          "sequence_cross_entropy": lambda out, y: sequence_cross_entropy(out, y,
                                                                          reduction="sum")}

EPILOG = """\
auditing your own code:
  --model mymod:make_model --data mymod:make_batch
      make_model() -> torch.nn.Module; make_batch() -> (inputs, targets), batch on dim 0.
      Replaces the model zoo in the gradient audits. A Hugging Face model (forward(input_ids)
      returning a ModelOutput) is audited on its logits; for a language model pass
      --loss sequence_cross_entropy (logits (n, T, V), targets (n, T)).
  --provider mymod:per_sample_grads
      per_sample_grads(model, loss_fn, inputs, targets) -> {param_name: Tensor(n, *shape)}
      (the signature of workbench.per_sample_gradients), or Tensor(n,) of per-sample norms.
      Audited against micro-batching on the zoo, or on --model/--data.
  --step mymod:make_step
      make_step(max_grad_norm, noise_multiplier, batch_size, generator) -> step_fn, with
      step_fn(G: Tensor(n, d)) -> Tensor(d) the privatised step (Σ clip(g_i) + noise) / B,
      as the factories in workbench.audit.bug_zoo. Runs the mechanism, clipping (σ = 0) and
      canary audits on it.
  --loss mymod:my_loss
      my_loss(outputs, targets) -> Tensor(n,), one loss term per record (replaces the built-in
      choices); the record-influence audit runs the engine on --model with it.
  --claim claim.yaml [--loader mymod:make_loader]
      A privacy claim (YAML or JSON; see workbench.audit.claim and examples/claims/): each
      element is checked against evidence (the step: --step or the workbench's optimizer; the
      loader: make_loader(dataset) -> iterable of index batches (unit: user claims:
      make_loader(dataset, user_ids), audited at the user level); the ε: every accountant at
      hand) and gets its own verdict on the report's cover.
  Record influence: the step is run without noise (σ = 0) on n + 1 records, one removed or
  replaced; the released sums may differ by at most C (2C). Randomness must come from torch's
  global RNG or a generator re-seeded per call (the audit replays it).
  Other libraries are audited when installed: Opacus (pip install opacus), BackPACK
  (pip install backpack-for-pytorch); otherwise their sections are SKIPPED with the reason.

exit codes: 0 passed, 1 the audit found a failure, 2 usage or input error

example:
  python -m workbench audit --quick --out audit-report
  python -m workbench audit --model mymod:make_model --data mymod:make_batch --loss mse
  python -m workbench audit --quick --claim examples/claims/false_claim.yaml \\
      --loader examples.claims.loaders:shuffled_loader \\
      --step workbench.audit.bug_zoo:noise_std_sigma_not_sigma_c
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workbench audit", epilog=EPILOG,
                                description=__doc__.split("\n\n")[1].replace("\n", " "),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("audit-report"),
                   help="folder for report.html and report.json (default: audit-report); "
                        "checked for writing before the audit runs")
    p.add_argument("--quick", action="store_true",
                   help="small settings, about a minute: two zoo models and the digits CNN, "
                        "200 trials, one accountant setting")
    p.add_argument("--model", help="module:callable returning your nn.Module (needs --data)")
    p.add_argument("--data", help="module:callable returning (inputs, targets), batch on dim 0")
    p.add_argument("--loss", default="cross_entropy",
                   help=f"per-sample loss: one of {', '.join(sorted(LOSSES))} (default: "
                        f"cross_entropy) or module:callable (see below)")
    p.add_argument("--claim", type=Path, help="a privacy claim to check, YAML or JSON")
    p.add_argument("--loader", metavar="MODULE:CALLABLE",
                   help="your data loader factory make_loader(dataset) (needs --claim)")
    p.add_argument("--provider", action="append", default=[], metavar="MODULE:CALLABLE",
                   help="your per-sample gradient implementation (repeatable; see below)")
    p.add_argument("--step", action="append", default=[], metavar="MODULE:CALLABLE",
                   help="your DP step factory (repeatable; see below)")
    p.add_argument("--trials", type=int, default=None,
                   help="mechanism-audit repetitions per designed batch, >= 50 "
                        "(default 400, --quick 200)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def inputs(args):
    """Everything the user named, loaded and checked (InputError on any problem)."""
    if args.data and not args.model:
        raise InputError("--data needs --model module:callable returning the nn.Module")
    if args.loader and not args.claim:
        raise InputError("--loader needs --claim (the claim gives the data set size N and the "
                         "sampling rate q the loader is audited at)")
    check_out(args.out)
    claim = load_claim(args.claim) if args.claim else None
    loss_fn = _loss(args.loss)
    cases = ([user_case(args.model, args.data, loss_fn, args.loss)] if args.model
             else cli_suite.zoo_cases(args.quick))
    providers = {spec: user_provider(spec, cases[0] if cases else None, loss_fn)
                 for spec in args.provider}
    steps = {spec: user_step(spec, cli_suite.C, cli_suite.SIGMA, cli_suite.B, cli_suite.DIM)
             for spec in args.step}
    loader = load_callable(args.loader, "--loader") if args.loader else None
    return loss_fn, cases, providers, steps, claim, loader


def _loss(spec: str):
    if spec in LOSSES:
        return LOSSES[spec]
    if ":" not in spec:
        raise InputError(f"--loss {spec!r}: choose one of {', '.join(sorted(LOSSES))} or give "
                         f"module:callable (my_loss(outputs, targets) -> Tensor(n,))")
    return load_callable(spec, "--loss")


def sections_of(args, loss_fn, cases, providers, steps, claim, loader) -> tuple:
    """Every report section (``write_report`` puts the subject's first); and the claim audit
    (or None)."""
    progress = not args.no_progress
    own = SELF_CHECK if (args.model or args.step or args.provider or claim) else SUBJECT
    out = cli_suite.gradient_sections(cases, loss_fn, providers, progress, own)
    out += cli_suite.privacy_sections(args, steps, progress, own)
    spec = next(iter(steps), None) if claim is not None else None  # the claim's step
    out += influence_sections(cli_suite.influence_case(args, cases), loss_fn,
                              {k: f for k, f in steps.items() if k != spec},  # not twice
                              cli_suite.C, cli_suite.B, SUBJECT if args.model else own)
    audit = None
    if claim is not None:
        audit = audit_claim(claim, step=steps.get(spec), step_name=f"your step {spec}"
                            if spec else "", loader=loader, trials=args.trials)
        out = [section("The claim, element by element", audit)] + \
            [section(title, result) for title, result in audit.evidence] + out
    return out, audit


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    if args.trials is None:
        args.trials = 200 if args.quick else 400
    try:
        if args.trials < 50:
            raise InputError(f"--trials must be >= 50 for the statistical tests to mean "
                             f"much; got {args.trials}")
        loss_fn, cases, providers, steps, claim, loader = inputs(args)
    except InputError as err:
        print(f"python -m workbench audit: error: {err}", file=sys.stderr)
        return 2
    start = time.monotonic()
    sections, audit = sections_of(args, loss_fn, cases, providers, steps, claim, loader)
    prov = provenance(argv, cli_suite.settings(args), cli_suite.SEEDS)
    prov["settings"]["runtime_s"] = f"{time.monotonic() - start:.0f}"
    html_path, json_path, doc = write_report(args.out, sections, prov, claim=audit)
    for part, c in doc["by_part"].items():
        print(f"{PARTS[part]}: {c['passed']} passed, {c['failed'] + c['informational']} "
              f"failed, {c['skipped']} skipped, {c['not_applicable']} not applicable")
    if audit is not None:
        print(audit.summary)
        for row in audit.table.itertuples():
            print(f"  {row.element}: {row.verdict} ({row.finding})")
    crashed = {s.title: s.finding for s in sections if str(s.finding).startswith("raised ")}
    print(f"{doc['verdict']} (skipped and not applicable never count as passed)")
    for title in doc["failed"]:
        print(f"  FAILED: {title}" + (f"\n    {crashed[title]}" if title in crashed else ""))
    for title in doc["informational_failures"]:
        print(f"  informational (another library): {title}")
    print(f"wrote {html_path} and {json_path}")
    return 0 if doc["passed"] else 1


__all__ = ["EPILOG", "LOSSES", "inputs", "main", "parser", "sections_of"]


if __name__ == "__main__":
    sys.exit(main())
