"""The headless main job: ``python -m workbench audit`` (also ``make audit``).

Runs the default audit suite and writes ``report.html`` and ``report.json`` to ``--out``:

1. gradient audit: every per-sample gradient method (and Opacus when installed) against
   micro-batching, on the bundled model zoo and the digits CNN on digits data;
2. mechanism audit: the workbench's own DP optimizer step (and the correct reference step)
   must pass; every step of the bug zoo must be flagged;
3. accountants: RDP against PLD for a few DP-SGD settings (PLD must never exceed RDP);
4. canary audit of the workbench's DP step (one run, Steinke, Nasr, Jagielski 2023): the
   empirical lower bound on ε must stay below the accountant's ε; and of a no-noise step,
   where it must exceed it.

Exits 1 if anything the workbench itself must pass fails (bug-zoo rows are *expected* to
fail the mechanism audit; the command checks that they do). ``--model module:callable`` and
``--data module:callable`` audit a user's model on a user's batch instead of the zoo.
"""

import argparse
import importlib
import sys
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench import accounting, data, models
from workbench.audit import bug_zoo
from workbench.audit.canary import audit_canaries
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.gradients import audit_gradients
from workbench.audit.mechanism import audit_dp_step
from workbench.audit.providers import available_providers
from workbench.audit.report import section, write_report

METHODS = ("einsum", "vmap", "ghost", "bookkeeping")
LOSSES = {"cross_entropy": nn.CrossEntropyLoss(reduction="none"),
          "mse": lambda out, y: ((out - y) ** 2).flatten(1).sum(1)}


def load_callable(spec: str, option: str):
    """'package.module:function' -> the function, or a clear error naming the option."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"{option} must look like module:callable (e.g. mymodels:make_net); "
                         f"got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"{option} {spec!r} could not be loaded: {err}") from None


def gradient_cases(args):
    """(name, model, inputs, targets) to audit: the user's, or the zoo plus digits."""
    if args.model:
        make_model = load_callable(args.model, "--model")
        make_data = load_callable(args.data, "--data") if args.data else None
        if make_data is None:
            raise SystemExit("--model needs --data module:callable returning (inputs, targets)")
        inputs, targets = make_data()
        return [(args.model, make_model(), inputs, targets)]
    n = 2 if args.quick else 4
    cases = []
    names = ["digits_mlp", "imdb_embedding"] if args.quick else list(models.ZOO)
    for name in names:
        torch.manual_seed(0)
        x, y = models.example_batch(name, n, generator=torch.Generator().manual_seed(0))
        if x.dtype == torch.int64:
            x = x[:, :16]  # shorter sequences: the micro-batching reference stays quick
        cases.append((name, models.make_model(name), x, y))
    train, _ = data.load_digits()
    torch.manual_seed(0)
    cases.append(("digits_cnn on digits", models.digits_cnn(), train.tensors[0][:n],
                  train.tensors[1][:n]))
    return cases


def accountant_table(quick: bool) -> pd.DataFrame:
    rows = []
    settings = [(256 / 60000, 1.1, 10_000)] if quick else [
        (256 / 60000, 1.1, 10_000), (0.01, 0.8, 1_000), (0.1, 2.0, 500), (1.0, 5.0, 10)]
    for q, sigma, steps in settings:
        rdp = accounting.epsilon(q, sigma, steps, 1e-5, accountant="rdp")
        pld = accounting.epsilon(q, sigma, steps, 1e-5, accountant="pld")
        rows.append({"q": q, "sigma": sigma, "steps": steps, "delta": 1e-5, "eps_rdp": rdp,
                     "eps_pld": pld, "passed": pld <= rdp * (1 + 1e-9)})
    return pd.DataFrame(rows)


def run(args) -> list:
    loss_fn = LOSSES[args.loss]
    found, missing = available_providers()
    providers = {k: v for k, v in found.items() if k != "torch_func"} or None
    C, sigma, B, dim = 1.5, 1.0, 8, 32
    tasks = [("gradients", case) for case in gradient_cases(args)]
    tasks += [("mechanism", name) for name in ("workbench", *bug_zoo.ZOO)]  # ZOO has CORRECT
    tasks += [("accountants", None), ("canary", "workbench"), ("canary", "no_noise")]
    sections = []
    for kind, item in tqdm(tasks, desc="audit", disable=args.no_progress):
        if kind == "gradients":
            name, model, x, y = item
            result = audit_gradients(model, loss_fn, x, y, methods=METHODS, providers=providers)
            ours = result.table["method"].isin(METHODS)
            s = section(f"Gradient audit: {name}", result)  # the workbench's methods: must pass
            s.table, s.passed = result.table[ours], bool(result.table[ours]["passed"].all())
            sections.append(s)
            if providers or missing:  # other libraries: findings about them, not failures
                other = section(f"Gradient audit of other libraries: {name}",
                                result.table[~ours], must_pass=False, note=(
                                    "not installed: " + "; ".join(
                                        f"{k}: {v}" for k, v in missing.items())
                                    if missing else ""))
                other.labels = ("agree with micro-batching", "disagree or fail")
                sections.append(other)
        elif kind == "mechanism":
            factory = workbench_step if item == "workbench" else bug_zoo.ZOO[item]
            step = factory(C, sigma, B, torch.Generator().manual_seed(1))
            result = audit_dp_step(step, dim=dim, batch_size=B, max_grad_norm=C,
                                   noise_multiplier=sigma, trials=args.trials,
                                   generator=torch.Generator().manual_seed(0))
            is_bug = item not in ("workbench", bug_zoo.CORRECT)
            title = f"Mechanism audit: {'bug zoo, ' if is_bug else ''}{item}"
            s = section(title, result, must_pass=not is_bug)
            if is_bug:  # the workbench's duty: to catch it
                s.note = bug_zoo.ZOO[item].__doc__.strip().splitlines()[0]
                s.must_pass, s.passed, s.labels = True, not s.passed, ("caught", "NOT CAUGHT")
            sections.append(s)
        elif kind == "accountants":
            sections.append(section("Accountants: RDP vs PLD (PLD must not exceed RDP)",
                                     accountant_table(args.quick)))
        else:
            factory = workbench_step if item == "workbench" else bug_zoo.ZOO[item]
            result = audit_canaries(factory, dim=1000, steps=10, sample_rate=0.5,
                                    max_grad_norm=C, noise_multiplier=4.0,
                                    generator=torch.Generator().manual_seed(0))
            s = section(f"Canary audit: {item} step (ε lower bound vs accountant)", result)
            if item != "workbench":  # privacy is broken: the lower bound must exceed ε
                s.passed, s.labels = not s.passed, ("caught", "NOT CAUGHT")
            sections.append(s)
    return sections


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench audit",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("audit-report"),
                        help="folder for report.html and report.json (default: audit-report)")
    parser.add_argument("--quick", action="store_true",
                        help="small settings: two zoo models, fewer trials (for tests and CI)")
    parser.add_argument("--model", help="audit your model: module:callable returning an "
                                        "nn.Module (with --data)")
    parser.add_argument("--data", help="module:callable returning (inputs, targets), batch on "
                                       "dim 0")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="cross_entropy",
                        help="per-sample loss for the gradient audit")
    parser.add_argument("--trials", type=int, default=None,
                        help="mechanism-audit repetitions per designed batch (default 400, "
                             "--quick 200)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.trials is None:
        args.trials = 200 if args.quick else 400
    if args.trials < 50:
        parser.error(f"--trials must be >= 50 for the statistical tests to mean much; "
                     f"got {args.trials}")
    sections = run(args)
    html_path, json_path = write_report(args.out, sections)
    failed = [s.title for s in sections if s.must_pass and not s.passed]
    print(f"wrote {html_path} and {json_path}")
    print(f"{len(sections) - len(failed)} passed, {len(failed)} failed")
    for title in failed:
        print(f"  FAILED: {title}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
