"""Memory benchmark: ``python -m workbench.bench memory``.

For each layer, width and batch size b, the peak memory of one forward + backward pass in
four modes, each measured on its own:

- ``plain``: Σ_i ℓ_i backward to the parameter gradients, no DP;
- ``einsum``: ``wb.clipped_grad_sum(method="einsum")``: the (b, *param) per-sample gradients
  are materialised, clipped and summed (what Opacus' GradSampleModule does);
- ``ghost`` and ``bookkeeping``: the clipped sum without materialising them (``clipping``).

**What is measured** (``bench.peak_memory``). The bytes the step needs live before it starts
(the layer's parameters and buffers, the inputs and labels) plus the peak of what it
allocates while it runs: on CUDA ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` (less what was allocated before), as in the Opacus paper's Table
3; on CPU (labelled "CPU (profiler)" in every row) the peak of the running sum of the
allocations and frees the torch profiler records during the call. Both are *allocated*
bytes, not the allocator's reserve or the process' RSS.

**Opacus beside it.** When Opacus is installed (and unless ``--no-compare``), the mode
``opacus`` measures its ``GradSampleModule`` forward + backward (per-sample gradients, no
clipping; ``bench.opacus_twin``), the paper's "GSM(module)"; for the recurrent and attention
layers the module is Opacus' own DP layer.

**The model beside it.** ``clipping.memory_model``: the Opacus paper's Eq. (1)-(2) for plain
and materialising steps (Yousefpour et al. 2021, arXiv 2109.12298, §3.2.2) and the
workbench's ghost model bC + 2L + bS, with S from the routes of ``clipping.ghost_routes``.
The ``*_error`` columns say by how much the predicted overhead factor differs from the
measured one here: (predicted - measured) / measured.

The layers, their default widths and the ``--widths all`` sweeps are those of
``bench.layer_specs`` (shared with ``bench layers``); the recurrent and attention layers are
measured through their DP twins in every mode. The memory widget's compute (the model over b
beside a measured table) is ``bench.memory_explore``.
"""

import sys

import pandas as pd
import torch

import workbench as wb
from workbench.bench import opacus_twin
from workbench.bench.layer_specs import LAYERS, make_case
from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.bench.steps import plain_step, sum_of_products
from workbench.bench.timing import benchmark_parser, device_name, parse_benchmark_args
from workbench.clipping.memory_model import (
    eq3_regime,
    ghost_scratch_bytes,
    layer_sizes,
    model_bytes,
)
from workbench.methods import CLIP_METHODS

# plain, then the functional API's methods but the loop and vmap (their memory is einsum's)
MODES = ("plain", *(m for m in CLIP_METHODS if m not in ("microbatch", "vmap")))
DP_MODES = MODES[1:]
ALL_MODES = (*MODES, "opacus")  # opacus: only where it is installed
BATCH_SIZES = (16, 32, 64, 128, 256, 512)

# Materialising modes hold about this many copies of the b·L per-sample gradients: the
# workbench's einsum step one, Opacus' GradSampleModule two (measured: its factor over plain
# is twice ours on Linear and Embedding). Used to skip steps that would not fit.
COPIES = {"einsum": 1, "opacus": 2}


def steps(layer, x, t, max_grad_norm: float = 1.0) -> dict:
    """{mode: a callable running one forward + backward in that mode}."""
    def dp(method):
        return lambda: wb.clipped_grad_sum(layer, sum_of_products, x, t, max_grad_norm,
                                           method=method)

    return {"plain": lambda: plain_step(layer, x, t), **{m: dp(m) for m in DP_MODES}}


def ghost_S(layer, x, t) -> int:
    """S of the ghost model for this layer (``clipping.memory_model``), from two samples."""
    return ghost_scratch_bytes(layer, sum_of_products, x[:2], t[:2])


def measure_layer(name: str, b: int, width: int | None = None, modes=MODES,
                  device: torch.device | str = "cpu", seed: int = 0,
                  max_GB: float = float("inf"), repeats: int = 1) -> dict:
    """One row: measured peak bytes per mode, the model's bytes, overheads and errors.

    A materialising mode whose per-sample gradients alone (``COPIES`` x b·L) would exceed
    ``max_GB`` is not run; its columns are NaN. Each mode is measured ``repeats`` times after
    a warm-up, and the largest peak is kept.
    """
    device = torch.device(device)
    layer, x, t = make_case(name, b, width, device, seed)
    width = LAYERS[name].width if width is None else width
    sizes = layer_sizes(layer, x, t)
    S = ghost_S(layer, x, t)
    resident = {mode: tensor_bytes(layer, x, t) for mode in ALL_MODES}
    run = steps(layer, x, t)
    if "opacus" in modes:
        twin = opacus_twin.opacus_layer(name, width, layer).to(device)
        run["opacus"] = opacus_twin.gsm_step(twin, sum_of_products, x, t)
        resident["opacus"] = tensor_bytes(twin, x, t)
    row = {"layer": name, "width": width, "batch_size": b, **sizes, "ghost_S_bytes": S}
    requested = [m for m in modes if m != "plain"]
    modes = ("plain", *[m for m in requested  # plain: the overheads' baseline
                        if COPIES.get(m, 0) * b * sizes["L_bytes"] <= max_GB * 2**30])
    for mode in modes:
        run[mode]()  # warm-up: one-off caches are not the step's memory
        row[f"{mode}_MB"] = max(peak_bytes(run[mode], device, resident[mode])
                                for _ in range(repeats)) / 2**20
    predicted = model_bytes(b, sizes["L_bytes"], sizes["C_bytes"], S)
    row["model_plain_MB"] = predicted["plain"] / 2**20
    row["model_plain_explains"] = row["model_plain_MB"] / row["plain_MB"]
    for mode in requested:  # the model even where a step was skipped as too large
        if mode in modes:
            row[f"{mode}_x"] = row[f"{mode}_MB"] / row["plain_MB"]
        if mode == "opacus":
            continue
        key = "ghost" if mode == "bookkeeping" else mode
        row[f"model_{mode}_x"] = predicted[key] / predicted["plain"]
        if mode in modes:
            row[f"{mode}_error"] = row[f"model_{mode}_x"] / row[f"{mode}_x"] - 1
    row["eq3_regime"] = eq3_regime(sizes["L/C"], b)
    row["device"] = device_name(device) if device.type == "cuda" else (
        f"CPU (profiler) {device_name(device)}")
    return row


def run(layers=tuple(LAYERS), batch_sizes=BATCH_SIZES, widths="default", modes=MODES,
        device="cpu", progress=None, max_GB=float("inf"), repeats=1) -> pd.DataFrame:
    """A DataFrame with one ``measure_layer`` row per (layer, width, b).

    ``modes`` may include "opacus" (``with_opacus`` adds it where Opacus is installed).
    """
    device = torch.device(device)
    jobs = [(name, w, b) for name in layers
            for w in (LAYERS[name].widths if widths == "all" else [LAYERS[name].width])
            for b in batch_sizes]
    rows = []
    for name, w, b in jobs:
        rows.append(measure_layer(name, b, w, modes, device, max_GB=max_GB, repeats=repeats))
        if progress:
            progress(name, w, b)
    table = pd.DataFrame(rows)
    table["torch"] = torch.__version__
    table["date"] = pd.Timestamp.now(tz="UTC").strftime("%Y-%m-%d")
    return table


def with_opacus(modes, compare: bool = True) -> list:
    """``modes`` with "opacus" if ``compare`` is on and it is installed or requested."""
    out = [m for m in modes if m != "opacus"]
    if compare and (opacus_twin.available() or "opacus" in modes):
        out.append("opacus")
    return out


def extra_memory(table: pd.DataFrame) -> pd.DataFrame:
    """Measured extra MB over plain beside the models' extra terms, per row.

    The models' *extra* terms, (b - 1)L for einsum (Eq. 2 - Eq. 1) and bS for ghost, do not
    depend on what Eq. (1) leaves out (intermediates), so they can be compared directly.
    """
    b, MB = table["batch_size"], 2**20
    out = table[["layer", "width", "batch_size", "L/C"]].copy()
    out["einsum extra MB"] = table["einsum_MB"] - table["plain_MB"]
    out["(b-1)L MB"] = (b - 1) * table["L_bytes"] / MB
    out["ghost extra MB"] = table["ghost_MB"] - table["plain_MB"]
    out["bS MB"] = b * table["ghost_S_bytes"] / MB
    return out


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per layer: measured vs predicted overhead at the largest batch size, mean errors."""
    rows = []
    for (name, width), part in table.groupby(["layer", "width"], sort=False):
        last = part.loc[part["batch_size"].idxmax()]
        row = {"layer": name, "width": width, "L/C": last["L/C"], "b": last["batch_size"]}
        for mode in DP_MODES:
            if f"{mode}_x" in part:
                row[f"{mode} x"] = last[f"{mode}_x"]
                row[f"model {mode} x"] = last[f"model_{mode}_x"]
                row[f"{mode} mean error"] = part[f"{mode}_error"].mean()
        if "opacus_x" in part:
            row["opacus x"] = last["opacus_x"]
        row["Eq.1 explains"] = part["model_plain_explains"].mean()
        rows.append(row)
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame) -> str:
    cols = ["layer", "width", "batch_size", "L/C", "plain_MB", "einsum_x", "model_einsum_x",
            "opacus_x", "ghost_x", "bookkeeping_x", "model_ghost_x"]
    return table[[c for c in cols if c in table]].to_string(
        index=False, float_format=lambda v: f"{v:.3g}")


def report(table: pd.DataFrame) -> str:
    """What ``main`` prints: the rows, the per-layer summary, the extra memory."""
    lines = [f"device: {table['device'][0]}   torch {torch.__version__}   peak allocated "
             f"memory; *_x = overhead factor over plain, model_* = Eq. (1)-(2) / ghost model",
             format_table(table), "",
             "Summary (largest batch size; errors = predicted / measured overhead - 1, "
             "averaged over batch sizes; the paper: Eq. (3) off by -23% to +41%)",
             summary(table).to_string(index=False, float_format=lambda v: f"{v:.3g}")]
    if {"einsum_MB", "ghost_MB"} <= set(table.columns):
        extra = extra_memory(table)
        lines += ["", "Extra memory over plain at the largest batch size, beside the models' "
                  "extra terms ((b-1)L: Eq. 2 - Eq. 1; bS: ghost)",
                  extra[extra["batch_size"] == extra["batch_size"].max()].to_string(
                      index=False, float_format=lambda v: f"{v:.3g}")]
    return "\n".join(lines)


def main(argv=None):
    parser = benchmark_parser("memory", __doc__, batch_sizes=BATCH_SIZES, repeats=1,
                              repeats_help="measurements per mode after a warm-up; the largest "
                                           "peak is kept (allocation is deterministic: one "
                                           "suffices)")
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES)
    parser.add_argument("--no-compare", action="store_true",
                        help="skip Opacus' GradSampleModule even when Opacus is installed")
    parser.add_argument("--max-GB", type=float, default=12.0,
                        help="skip materialising modes whose per-sample gradients alone would "
                             "exceed this (their columns are then empty)")
    parser.add_argument("--widths", choices=["default", "all"], default="default",
                        help="'all' sweeps each layer's widths (L/C from small to large, "
                             "as the paper's Fig. 3 does for the embedding)")
    args = parse_benchmark_args(parser, argv)
    table = run(args.layers, args.batch_sizes, args.widths,
                with_opacus(args.modes, not args.no_compare), args.device,
                progress=lambda *job: print("measured", *job, file=sys.stderr, flush=True),
                max_GB=args.max_GB, repeats=args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(report(table))
    print(f"wrote {args.out}")
    return 0


__all__ = [
    "ALL_MODES", "BATCH_SIZES", "COPIES", "DP_MODES", "MODES", "extra_memory", "format_table",
    "ghost_S", "main", "measure_layer", "report", "run", "steps", "summary", "with_opacus",
]
