"""Every benchmark in one run: ``python -m workbench.bench all``.

Runs ``layers`` (with the DP layers), ``e2e``, ``memory`` (every layer at its default width,
and the width sweep of the embedding for Fig. 3) and ``accounting``, writes their CSVs to
``--out-dir`` and draws two figures in the style of the Opacus paper (Yousefpour et al.
2021, arXiv 2109.12298):

- ``fig2_overheads.png`` (its Fig. 2): per layer against batch size, the runtime overhead of
  materialised per-sample gradients (einsum / plain), and the peak-memory overhead of einsum
  and of ghost clipping, with the memory model's prediction for einsum dashed;
- ``fig3_embedding.png`` (its Fig. 3): the embedding at several vocabulary sizes (so L/C),
  measured against Eq. (2)/(1), for einsum and for ghost clipping.

``--quick`` shrinks everything (batch sizes 16 and 64, one repeat, fewer models) to check
the pipeline in a minute; its numbers are not for reporting.
"""

import argparse
from pathlib import Path

import pandas as pd
import torch
from matplotlib.figure import Figure

from workbench.bench import accounting, dp_layers, e2e, layers, memory, opacus_twin
from workbench.outputs import output_dir_arg
from workbench.viz.memory import plot_overheads, plot_sweep


def runtime_overheads(layers_csv: Path, dp_csv: Path) -> pd.DataFrame:
    """One table: einsum / plain per layer (torch.nn layers; DP layers over their torch.nn)."""
    plain = pd.read_csv(layers_csv)
    plain["einsum/plain"] = plain["einsum"] / plain["plain"]
    plain["plain_ms"] = 1e3 * plain["plain"]  # seconds in the CSV
    parts = [plain[["layer", "batch_size", "einsum/plain", "plain_ms"]]]
    if dp_csv.is_file():
        dp = pd.read_csv(dp_csv).rename(columns={"einsum/torch": "einsum/plain"})
        parts.append(dp[["layer", "batch_size", "einsum/plain"]])
    return pd.concat(parts, ignore_index=True)


#: A runtime overhead below this cannot be real: the einsum step runs the plain backward and
#: more, so einsum / plain < 1 means the plain baseline of that point was slow by chance.
NOISY_BELOW = 0.9


def mark_noisy_baselines(ax, runtime: pd.DataFrame) -> pd.DataFrame:
    """Ring and label every runtime overhead below NOISY_BELOW (a noisy plain baseline,
    e.g. Linear at b = 16 on the shipped CPU run: plain 3.44 ms, 0.84 ms at b = 64), so that
    the figure explains it; returns those rows."""
    same_layer = runtime["plain_ms"].notna() if "plain_ms" in runtime else False
    noisy = runtime[(runtime["einsum/plain"] < NOISY_BELOW) & same_layer]  # DP layers: not
    # the same layer as their torch.nn baseline, so below 1 is possible there
    for _, row in noisy.iterrows():
        ax.plot(row["batch_size"], row["einsum/plain"], "o", markersize=11, fillstyle="none",
                color="red", markeredgewidth=1.2)
        ax.annotate(f"{row['layer']}, b = {row['batch_size']}: {row['einsum/plain']:.2f}x: "
                    f"noisy plain baseline\n({row['plain_ms']:.2f} ms); einsum cannot beat plain",
                    (row["batch_size"], row["einsum/plain"]), xytext=(12, 0),
                    textcoords="offset points", fontsize="x-small", color="red", va="center")
    return noisy


def figure_2(runtime: pd.DataFrame, mem: pd.DataFrame, device: str) -> Figure:
    fig = Figure(figsize=(15, 4.2), dpi=100)
    axes = fig.subplots(1, 3)
    plot_overheads(axes[0], runtime, "einsum/plain", "runtime / plain (einsum)")
    axes[0].set_title("runtime overhead, materialised per-sample gradients", fontsize="small")
    mark_noisy_baselines(axes[0], runtime)
    lines = plot_overheads(axes[1], mem, "einsum_x", "peak memory / plain (einsum)")
    for name, line in lines.items():  # the model's prediction, dashed, same colour
        part = mem[mem["layer"] == name].sort_values("batch_size")
        axes[1].plot(part["batch_size"], part["model_einsum_x"], linestyle="--",
                     color=line.get_color(), linewidth=0.8)
    axes[1].set_title("peak memory overhead, einsum (dashed: Eq. (2) / Eq. (1))",
                      fontsize="small")
    plot_overheads(axes[2], mem, "ghost_x", "peak memory / plain (ghost)", log_y=False)
    axes[2].set_title("peak memory overhead, ghost clipping", fontsize="small")
    version = mem["torch"].iloc[0] if "torch" in mem else torch.__version__  # as measured
    fig.suptitle(f"Overheads against batch size per layer ({device}, torch "
                 f"{version}); cf. Opacus paper Fig. 2", fontsize="medium")
    fig.tight_layout()
    return fig


def figure_3(sweep: pd.DataFrame, device: str) -> Figure:
    fig = Figure(figsize=(11, 4.2), dpi=100)
    axes = fig.subplots(1, 2)
    plot_sweep(axes[0], sweep, "embedding", "einsum")
    axes[0].set_title("einsum (materialised)", fontsize="small")
    plot_sweep(axes[1], sweep, "embedding", "ghost")
    axes[1].set_title("ghost clipping (dashed: ghost model)", fontsize="small")
    fig.suptitle(f"Embedding: memory overhead at several vocabulary sizes ({device}); "
                 f"cf. Opacus paper Fig. 3", fontsize="medium")
    fig.tight_layout()
    return fig


def save(table: pd.DataFrame, path: Path, report: str) -> pd.DataFrame:
    """Write ``table`` to ``path`` and print its report, as the benchmark's own main does."""
    table.to_csv(path, index=False)
    print(report, f"wrote {path}", "", sep="\n")
    return table


def run(out: Path, device: str, repeats: int = 5, quick: bool = False) -> dict:
    """Every benchmark into ``out``: {CSV name: table}; then the two figures."""
    out.mkdir(parents=True, exist_ok=True)
    repeats = 1 if quick else repeats
    sizes = [16, 64] if quick else [16, 64, 256]
    mem_sizes = sizes if quick else list(memory.BATCH_SIZES)
    compare = opacus_twin.available()
    mem_modes = memory.with_opacus(memory.MODES)
    e2e_quick = dict(models=["mnist_cnn"], methods=["einsum", "ghost", "bookkeeping"])
    benchmarks = {  # CSV name -> (the run, the report of its main)
        "layers": (lambda: layers.run(batch_sizes=sizes, repeats=repeats, device=device,
                                      compare=compare), layers.report),
        "layers_dp": (lambda: dp_layers.run(layers=list(dp_layers.LAYERS), batch_sizes=sizes,
                                            repeats=repeats, device=torch.device(device),
                                            compare=compare), dp_layers.report),
        "e2e": (lambda: e2e.run(batch_sizes=[16] if quick else [64, 256], repeats=repeats,
                                device=device, **(e2e_quick if quick else {})), e2e.report),
        "memory": (lambda: memory.run(batch_sizes=mem_sizes, modes=mem_modes, device=device),
                   memory.report),
        "memory_embedding_sweep": (lambda: memory.run(layers=["embedding"], widths="all",
                                                      batch_sizes=mem_sizes, modes=mem_modes,
                                                      device=device), memory.report),
        "accounting": (lambda: accounting.run(repeats=repeats,
                                              **(dict(steps=100) if quick else {})),
                       accounting.report),
    }
    tables = {}
    for name, (bench, report) in benchmarks.items():
        table = bench()
        tables[name] = save(table, out / f"{name}.csv", report(table))
    mem = tables["memory"]
    name = mem["device"].iloc[0]
    runtime = runtime_overheads(out / "layers.csv", out / "layers_dp.csv")
    figure_2(runtime, mem, name).savefig(out / "fig2_overheads.png")
    figure_3(tables["memory_embedding_sweep"], name).savefig(out / "fig3_embedding.png")
    return tables


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m workbench.bench all",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=output_dir_arg("--out-dir"), default="bench-results",
                        help="folder for the CSVs and figures (checked for writing first)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings to check the pipeline (numbers not for reporting)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    run(args.out_dir, args.device, args.repeats, args.quick)
    out = args.out_dir
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


__all__ = [
    "NOISY_BELOW", "figure_2", "figure_3", "main", "mark_noisy_baselines", "run",
    "runtime_overheads", "save",
]
