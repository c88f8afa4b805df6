"""The cost of never being silently wrong: checked against unchecked, side by side.

Every einsum, ghost and book-keeping call tracks each use of each parameter and checks its
result (``per_sample/selfcheck.py``): the first call of a model with a given call signature
runs a one-sample probe (one forward and backward pass at batch size 1) and compares with
micro-batching; later calls reuse the verdict. This benchmark times, interleaved in one run:

- ``unchecked``: ``check=False`` (the use tracker still runs: it decides exactness);
- ``checked``: the default ``check=True`` in steady state (verdict cached);
- ``always``: ``check="always"``, the probe and comparison on every call (the first-call cost);

on the layers of ``bench layers`` (per-sample gradients, einsum), the models of ``bench
e2e`` (clipped sums, einsum and book-keeping), and the DP optimizer on those models over 8
steps of Poisson-like sizes around b (``optimizer.verify`` True, False, "always": every new
call signature, with n symbolic, is verified, and its loss probed). Target: checked /
unchecked ≤ 1.3.

    python -m workbench.bench selfcheck [--batch-sizes 16 64 256] [--repeats 5]
"""

import sys

import pandas as pd
import torch

import workbench as wb
from workbench import models
from workbench.bench.e2e import DEFAULT_MODELS, LOSS
from workbench.bench.layer_specs import TORCH_LAYERS, make_case
from workbench.bench.steps import sum_of_products
from workbench.bench.timing import (
    benchmark_parser,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)

MODES = {"unchecked": False, "checked": True, "always": "always"}


def _ratios(row: dict, times: dict, prefix: str = "") -> dict:
    for mode, t in times.items():
        row[f"{mode}_ms"] = t * 1e3
    row["checked/unchecked"] = times["checked"] / times["unchecked"]
    row["always/unchecked"] = times["always"] / times["unchecked"]
    return row


def bench_layer(name, b, repeats, device, seed=0) -> dict:
    layer, x, t = make_case(name, b, device=device, seed=seed)
    candidates = {mode: (lambda c=check: wb.per_sample_gradients(
        layer, sum_of_products, x, t, method="einsum", check=c)) for mode, check in MODES.items()}
    times = time_interleaved(candidates, device, repeats=repeats)
    return _ratios({"case": f"layer {name}", "method": "einsum", "batch_size": b}, times)


def bench_model(name, b, method, repeats, device) -> dict:
    model = models.make_model(name).to(device)
    x, y = models.example_batch(name, b, generator=torch.Generator().manual_seed(0))
    x, y = x.to(device), y.to(device)
    candidates = {mode: (lambda c=check: wb.clipped_grad_sum(
        model, LOSS, x, y, 1.0, method=method, check=c)) for mode, check in MODES.items()}
    times = time_interleaved(candidates, device, repeats=repeats)
    return _ratios({"case": f"model {name}", "method": method, "batch_size": b}, times)


def bench_optimizer(name, b, repeats, device, steps=8) -> dict:
    """One DP-optimizer pass over ``steps`` batches of sizes ~ Binomial around b."""
    from workbench.dpsgd.optimizer import DPOptimizer

    g = torch.Generator().manual_seed(0)
    sizes = torch.binomial(torch.full((steps,), float(b)), torch.full((steps,), 0.5),
                           generator=g).mul(2).long().clamp(min=2).tolist()
    batches = [tuple(t.to(device) for t in models.example_batch(name, n, generator=g))
               for n in sizes]
    ce = torch.nn.CrossEntropyLoss()
    candidates = {}
    for mode, check in MODES.items():
        model = models.make_model(name).to(device)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=b)
        opt.verify = check

        def run_steps(model=model, opt=opt):
            for x, y in batches:
                opt.zero_grad()
                ce(model(x), y).backward()
                opt.step()

        candidates[mode] = run_steps
    times = time_interleaved(candidates, device, repeats=repeats)
    return _ratios({"case": f"optimizer {name}", "method": "auto", "batch_size": b}, times)


def run(batch_sizes, repeats, device, methods=("einsum", "bookkeeping"), layers=TORCH_LAYERS,
        zoo=tuple(DEFAULT_MODELS)) -> pd.DataFrame:
    rows = [bench_layer(name, b, repeats, device) for name in layers for b in batch_sizes]
    rows += [bench_model(name, b, method, repeats, device) for name in zoo
             for b in batch_sizes for method in methods]
    rows += [bench_optimizer(name, b, repeats, device) for name in zoo for b in batch_sizes]
    table = pd.DataFrame(rows)
    table["device"] = device_name(device)
    table["torch"] = torch.__version__
    return table


def main(argv=None):
    parser = benchmark_parser("selfcheck", __doc__, batch_sizes=(16, 64, 256))
    args = parse_benchmark_args(parser, argv)
    table = run(args.batch_sizes, args.repeats, torch.device(args.device))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    cols = ["case", "method", "batch_size", "unchecked_ms", "checked/unchecked",
            "always/unchecked"]
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


__all__ = ["MODES", "bench_layer", "bench_model", "bench_optimizer", "main", "run"]


if __name__ == "__main__":
    sys.exit(main())
