"""Per-layer benchmark: ``python -m workbench.bench layers``.

For each layer and batch size b, one run measures side by side (interleaved medians):

- ``plain``: forward + backward of Σ_i ℓ_i without per-sample gradients;
- ``microbatch`` / ``vmap`` / ``einsum``: ``wb.per_sample_gradients`` with that method;
- ``opacus`` (when Opacus is installed, unless ``--no-compare``): its GradSampleModule
  forward + backward on the same layer, the per-sample gradients in ``p.grad_sample``;
- ``floor``: the time to write the (b, *param) per-sample tensors into fresh memory at the
  copy bandwidth measured in the same run (``timing.copy_bandwidth``): no method that
  returns them can beat plain + floor.

Ratios (microbatch/einsum, vmap/einsum, einsum/(plain + floor)) are what to compare across
machines; absolute times only with the device named (every row records it). The layers
follow the Opacus paper's per-layer benchmarks (Yousefpour et al. 2021, arXiv 2109.12298,
§3.2, Fig. 2) and the sizes quoted in the workbench's issues: the torch.nn layers of
``bench.layer_specs`` at their default widths (``bench memory`` measures the same layers).
Unless ``--no-dp-layers``, ``bench dp_layers`` runs after it on the DP recurrent and
attention layers and writes its own CSV beside this one (``*_dp.csv``).
"""


import pandas as pd
import torch

import workbench as wb
from workbench.bench import dp_layers, opacus_twin
from workbench.bench.layer_specs import TORCH_LAYERS, make_case
from workbench.bench.steps import plain_step, sum_of_products
from workbench.bench.timing import (
    benchmark_parser,
    copy_bandwidth,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.per_sample import memory


def bench_layer(name, b, methods, repeats, device, bandwidth, seed=0, compare=False):
    """One row per (layer, b): median seconds per candidate, the floor and the ratios.

    ``compare``: also time Opacus' GradSampleModule (``bench.opacus_twin``) on the layer.
    """
    layer, x, t = make_case(name, b, device=device, seed=seed)
    candidates = {"plain": lambda: plain_step(layer, x, t)}
    for method in methods:
        candidates[method] = (lambda m=method: wb.per_sample_gradients(
            layer, sum_of_products, x, t, method=m))
    if compare:
        twin = opacus_twin.opacus_layer(name, None, layer).to(device)
        candidates["opacus"] = opacus_twin.gsm_step(twin, sum_of_products, x, t)
    times = time_interleaved(candidates, device, repeats=repeats)
    per_sample_bytes = sum(b * p.numel() * p.element_size() for p in layer.parameters())
    row = {"layer": name, "batch_size": b, "params": sum(p.numel() for p in layer.parameters()),
           "per_sample_MB": per_sample_bytes / 2**20, "floor": per_sample_bytes / bandwidth}
    row.update(times)
    row["plain+floor"] = row["plain"] + row["floor"]
    if "einsum" in times:
        for other in ("microbatch", "vmap"):
            if other in times:
                row[f"{other}/einsum"] = times[other] / times["einsum"]
        row["einsum/(plain+floor)"] = times["einsum"] / row["plain+floor"]
        if "opacus" in times:
            row["opacus/einsum"] = times["opacus"] / times["einsum"]
    return row


def run(layers=TORCH_LAYERS, batch_sizes=(16, 64, 256), methods=tuple(wb.METHODS), repeats=5,
        device="cpu", compare=False) -> pd.DataFrame:
    """One ``bench_layer`` row per (layer, b), with the device and the copy bandwidths."""
    device = torch.device(device)
    bandwidth = copy_bandwidth(device, fresh=True)
    warm = copy_bandwidth(device, fresh=False)
    rows = [bench_layer(name, b, methods, repeats, device, bandwidth, compare=compare)
            for name in layers for b in batch_sizes]
    table = pd.DataFrame(rows)
    table["device"] = device_name(device)
    table["torch"] = torch.__version__
    table["copy_GBps"] = bandwidth / 1e9
    table["warm_copy_GBps"] = warm / 1e9
    table["huge_pages"] = memory.HUGE_PAGES
    return table


def report(table: pd.DataFrame) -> str:
    """What ``main`` prints: the device, the copy bandwidths and the table."""
    return (f"device: {table['device'][0]}   torch {torch.__version__}   "
            f"copy into fresh memory {table['copy_GBps'][0]:.1f} GB/s "
            f"(reused: {table['warm_copy_GBps'][0]:.1f} GB/s)   times in ms\n"
            + format_table(table))


def format_table(table: pd.DataFrame) -> str:
    ms = [c for c in ("plain", "floor", "microbatch", "vmap", "einsum", "opacus") if c in table]
    shown = table[["layer", "batch_size", *ms]].copy()
    shown[ms] = shown[ms] * 1e3
    ratios = [c for c in table.columns if "/" in c]
    shown[ratios] = table[ratios]
    return shown.to_string(index=False, float_format=lambda v: f"{v:.3g}")


def main(argv=None):
    parser = benchmark_parser("layers", __doc__)
    parser.add_argument("--layers", nargs="+", default=list(TORCH_LAYERS), choices=TORCH_LAYERS)
    parser.add_argument("--methods", nargs="+", default=list(wb.METHODS), choices=wb.METHODS)
    parser.add_argument("--no-dp-layers", action="store_true",
                        help="skip the DP recurrent/attention layers (python -m workbench.bench "
                             "dp_layers runs them alone)")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip Opacus' GradSampleModule even when Opacus is installed")
    parser.add_argument("--huge-pages", action="store_true",
                        help="back large per-sample tensors by 2 MiB pages (per_sample.memory)")
    args = parse_benchmark_args(parser, argv)
    if args.huge_pages:
        memory.HUGE_PAGES = True
    compare = opacus_twin.available() and not args.no_compare
    table = run(args.layers, args.batch_sizes, args.methods, args.repeats, args.device,
                compare=compare)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(report(table))
    print(f"wrote {args.out}")
    if not args.no_dp_layers:  # the DP layers: torch.nn vs DP module vs DP + per-sample
        dp_out = args.out.with_name(args.out.stem + "_dp.csv")
        dp = dp_layers.run(dp_layers.LAYERS, args.batch_sizes, args.repeats,
                           torch.device(args.device), compare=compare)
        dp.to_csv(dp_out, index=False)
        print()
        print(dp_layers.report(dp))
        print(f"wrote {dp_out}")
    return 0


__all__ = ["bench_layer", "format_table", "main", "report", "run"]
