"""Accountant speed: ``python -m workbench.bench accounting``.

Four tasks, each timed side by side with the other libraries that are installed (interleaved
rounds, medians; ``timing.time_interleaved``):

- ``rdp_epsilon``: ε after T steps with the default orders (Opacus: ``RDPAccountant``).
- ``rdp_curve``: ε after each of 100 step counts up to T (Opacus: ``compute_rdp`` once and
  ``get_privacy_spent`` per point, its fastest public route).
- ``noise_multiplier``: σ for a target ε after T steps, tolerance 0.01 (Opacus:
  ``get_noise_multiplier``).
- ``pld_epsilon``: ε after T steps by PLD, grid 1e-4 (Opacus: ``PRVAccountant``, a different
  numerical accountant; dp-accounting: ``PLDAccountant`` at the same grid).

Each row carries the ε (or σ) every library returned, so the speed is read next to the answer,
the target time of the workbench's issue, and the device. Opacus and dp-accounting are optional
(``pip install opacus dp-accounting``); their columns are empty when they are absent.
"""

import argparse
import importlib
import warnings

import numpy as np
import pandas as pd
import torch

from workbench import accounting
from workbench.bench.timing import device_name, time_interleaved
from workbench.outputs import output_file_arg

TARGET_MS = {"rdp_epsilon": 2, "rdp_curve": 20, "noise_multiplier": 20, "pld_epsilon": 500}


def have(module):
    """True when ``module`` imports (an optional library, installed and working)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def ours(task, q, sigma, steps, delta, target):
    curve_steps = np.linspace(steps / 100, steps, 100).round().astype(int)
    return {
        "rdp_epsilon": lambda: accounting.epsilon(q, sigma, steps, delta),
        "rdp_curve": lambda: accounting.epsilon_curve(q, sigma, curve_steps, delta)[-1],
        "noise_multiplier": lambda: accounting.get_noise_multiplier(target, delta, q, steps=steps),
        "pld_epsilon": lambda: accounting.epsilon(q, sigma, steps, delta, accountant="pld"),
    }[task]


def opacus(task, q, sigma, steps, delta, target):
    from opacus.accountants import PRVAccountant, RDPAccountant
    from opacus.accountants.analysis import rdp as analysis
    from opacus.accountants.utils import get_noise_multiplier

    def rdp_epsilon():
        acc = RDPAccountant()
        acc.history = [(sigma, q, steps)]
        return acc.get_epsilon(delta)

    def rdp_curve():
        orders = RDPAccountant.DEFAULT_ALPHAS
        rdp = analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders)
        return [analysis.get_privacy_spent(orders=orders, rdp=rdp * t, delta=delta)[0]
                for t in np.linspace(steps / 100, steps, 100).round()][-1]

    def prv():
        acc = PRVAccountant()
        acc.history = [(sigma, q, steps)]
        return acc.get_epsilon(delta)

    return {
        "rdp_epsilon": rdp_epsilon,
        "rdp_curve": rdp_curve,
        "noise_multiplier": lambda: get_noise_multiplier(
            target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps,
            accountant="rdp", epsilon_tolerance=0.01),
        "pld_epsilon": prv,
    }[task]


def dp_accounting(task, q, sigma, steps, delta, target):
    if task != "pld_epsilon":
        return None
    import dp_accounting as dpa

    def pld():
        acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
        event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
        acc.compose(dpa.SelfComposedDpEvent(event, steps))
        return acc.get_epsilon(delta)

    return pld


def bench_task(task, params, libraries, repeats):
    """One row: ``task`` timed for the workbench and each library, at ``params`` =
    (sample_rate, noise_multiplier, steps, delta, target_epsilon)."""
    candidates = {"workbench": ours(task, *params)}
    for name, factory in libraries.items():
        fn = factory(task, *params)
        if fn is not None:
            candidates[name] = fn
    values = {name: float(fn()) for name, fn in candidates.items()}
    repeats = {"pld_epsilon": max(1, repeats // 2)}.get(task, repeats)
    times = time_interleaved(candidates, torch.device("cpu"), repeats=repeats, warmup=0)
    row = {"task": task, "target_ms": TARGET_MS[task]}
    for name in candidates:
        row[f"{name}_ms"] = times[name] * 1e3
        row[f"{name}_value"] = values[name]
        if name != "workbench":
            row[f"{name}/workbench"] = times[name] / times["workbench"]
    row["meets_target"] = row["workbench_ms"] <= TARGET_MS[task]
    return row


def run(tasks=tuple(TARGET_MS), sample_rate=256 / 60_000, noise_multiplier=1.1, steps=10_000,
        delta=1e-5, target_epsilon=3.0, repeats=7, compare=True) -> pd.DataFrame:
    """One ``bench_task`` row per task; ``compare``: Opacus and dp-accounting beside ours."""
    libraries = {} if not compare else {
        name: factory for name, factory, module in
        [("opacus", opacus, "opacus"), ("dp_accounting", dp_accounting, "dp_accounting")]
        if have(module)}
    params = (sample_rate, noise_multiplier, steps, delta, target_epsilon)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about its order range at small ε
        table = pd.DataFrame([bench_task(task, params, libraries, repeats) for task in tasks])
    table["device"] = device_name(torch.device("cpu"))
    for column, value in [("sample_rate", sample_rate), ("noise_multiplier", noise_multiplier),
                          ("steps", steps), ("delta", delta)]:
        table[column] = value
    return table


def report(table: pd.DataFrame) -> str:
    """What ``main`` prints: the setting, then ms, ratios and values per task."""
    first = table.iloc[0]
    shown = [c for c in table.columns if c.endswith(("_ms", "/workbench", "_value"))]
    return (f"device: {first['device']}   q={first['sample_rate']:.4g} "
            f"σ={first['noise_multiplier']} T={first['steps']} δ={first['delta']}   times in "
            f"ms (median of interleaved rounds)\n"
            + table[["task", *shown, "meets_target"]].to_string(
                index=False, float_format=lambda v: f"{v:.4g}"))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m workbench.bench accounting",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TARGET_MS), choices=list(TARGET_MS))
    parser.add_argument("--sample-rate", type=float, default=256 / 60_000)
    parser.add_argument("--noise-multiplier", type=float, default=1.1)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--no-compare", action="store_true", help="skip Opacus / dp-accounting")
    parser.add_argument("--out", type=output_file_arg("--out"),
                        default="bench-results/accounting.csv",
                        help="CSV file for the results (checked for writing before the run)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    table = run(args.tasks, args.sample_rate, args.noise_multiplier, args.steps, args.delta,
                args.target_epsilon, args.repeats, compare=not args.no_compare)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(report(table))
    print(f"wrote {args.out}")
    return 0


__all__ = [
    "TARGET_MS", "bench_task", "dp_accounting", "have", "main", "opacus", "ours", "report", "run",
]
