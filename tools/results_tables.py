"""Print the README's results tables (markdown) from benchmark CSVs.

    python tools/results_tables.py [--e2e bench-results/e2e.csv]
        [--gpt bench-results/e2e_gpt.csv] [--training bench-results/training.csv]
        [--accounting bench-results/accounting.csv] [--only training ...]

Memory and per-layer runtime come from the CSVs shipped in data/bench/; the end-to-end,
training-step and accounting tables from fresh runs of ``python -m workbench.bench e2e`` /
``training`` / ``accounting``
(skipped when their CSVs are absent). Nothing is typed in by hand.
"""

import argparse
import sys
from pathlib import Path

import pandas as pd

from workbench.data import bundled

ROOT = Path(__file__).resolve().parents[1]
BENCH = bundled("bench")  # data/bench/, the package's shipped CSVs


def fmt(v, digits=3):
    if pd.isna(v):
        return "–"
    return f"{v:.{digits}g}"


def times(v):
    """A ratio as ``1.5x``; a missing one (the candidate could not run) as ``–``."""
    return "–" if pd.isna(v) else f"{fmt(v)}x"


def markdown(rows, header):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_table(b=256):
    from workbench.bench.layer_specs import LAYERS
    from workbench.bench.memory_explore import load

    t = load(BENCH / "memory_cpu.csv")
    t = t[(t["width"] == t["layer"].map(lambda n: LAYERS[n].width))
          & (t["batch_size"] == b)]
    rows = [[f"{r.layer} ({r.width})", fmt(r["L/C"]), fmt(r.plain_MB),
             f"{fmt(r.einsum_x)}x ({fmt(r.model_einsum_x)}x)",
             f"{fmt(r.get('opacus_x'))}x", f"{fmt(r.ghost_x)}x ({fmt(r.model_ghost_x)}x)",
             f"{fmt(r.bookkeeping_x)}x"] for _, r in t.iterrows()]
    header = ["layer (width)", "L/C", "plain MB", "einsum (model)", "Opacus GSM",
              "ghost (model)", "book-keeping"]
    return f"Peak allocated memory at b = {b}, over plain ({t['device'].iloc[0]}):\n\n" + \
        markdown(rows, header)


def runtime_table(b=256):
    t = pd.read_csv(BENCH / "layers_cpu.csv")
    t = t[t["batch_size"] == b]
    rows = [[r.layer, fmt(1e3 * r.plain), fmt(1e3 * r.einsum), fmt(r.einsum / r.plain),
             fmt(1e3 * r.get("opacus", float("nan"))), fmt(r.get("opacus/einsum")),
             fmt(r["vmap/einsum"]), fmt(r["microbatch/einsum"])] for _, r in t.iterrows()]
    header = ["layer", "plain ms", "einsum ms", "einsum / plain", "Opacus ms",
              "Opacus / einsum", "vmap / einsum", "microbatch / einsum"]
    text = (f"Per-sample gradients of one layer at b = {b} ({t['device'].iloc[0]}):\n\n"
            + markdown(rows, header))
    dp = pd.read_csv(BENCH / "layers_cpu_dp.csv")
    dp = dp[dp["batch_size"] == b]
    rows = [[r.layer, fmt(1e3 * r.torch), fmt(1e3 * r.dp), fmt(1e3 * r.dp_einsum),
             fmt(1e3 * r.get("opacus", float("nan"))), fmt(r.get("opacus/einsum"))]
            for _, r in dp.iterrows()]
    header = ["DP layer", "torch.nn ms", "workbench DP layer ms", "+ per-sample (einsum) ms",
              "Opacus DP layer + GSM ms", "Opacus / einsum"]
    return text + f"\n\nRecurrent and attention layers (T = 32, size 64) at b = {b}:\n\n" + \
        markdown(rows, header)


def e2e_table(path):
    t = pd.read_csv(path)
    methods = [c[:-len("/plain")] for c in t.columns
               if c.endswith("/plain") and "_mem" not in c]
    rows = [[r.model, r.batch_size, fmt(r.plain_ms),
             *[f"{fmt(r[f'{m}/plain'])}x / {fmt(r[f'{m}_mem/plain'])}x" for m in methods]]
            for _, r in t.iterrows()]
    header = ["model", "b", "plain ms", *[f"{m} (time / memory)" for m in methods]]
    return (f"One clipped-sum step of the Opacus paper's models, as multiples of a plain step "
            f"({t['device'].iloc[0]}):\n\n" + markdown(rows, header))


def gpt_table(path):
    """The tiny_gpt rows of ``bench e2e --models tiny_gpt tiny_gpt_10x``: full fine-tuning and
    LoRA, each DP method against its own plain step, and the gradient audit's verdict."""
    t = pd.read_csv(path)
    rows = []
    for _, r in t.iterrows():
        for prefix, plain in (("", "plain"), ("lora_", "lora_plain")):
            for m in ("einsum", "ghost", "bookkeeping", "opacus"):
                col = f"{prefix}{m}/{plain}"
                if col not in t or pd.isna(r[col]):
                    continue
                audit = r.get(f"{m}_audit", "") if not prefix else ""
                rows.append([r.model, f"{int(r.params):,}", "LoRA" if prefix else "full", m,
                             f"{fmt(r[col])}x", f"{fmt(r[f'{prefix}{m}_mem/{plain}'])}x",
                             audit if isinstance(audit, str) else ""])
    header = ["model", "params", "trained", "method", "time / plain", "peak memory / plain",
              "per-sample gradients (audit)"]
    r0 = t.iloc[0]
    return (f"The nanoGPT-style tiny_gpt, one DP step at b = {r0.batch_size}, T = {r0.seq_len} "
            f"({r0.device}; Opacus: GradSampleModule's per-sample gradients, unclipped):\n\n"
            + markdown(rows, header))


def training_table(path):
    """``bench training``: one whole DP-optimizer step (zero_grad, forward, backward, step) per
    mode over one plain SGD step, Opacus' own loop beside it, and peak memory over plain's."""
    t = pd.read_csv(path)
    modes = [c[:-len("/plain")] for c in t.columns if c.endswith("/plain")]
    peaks = [c for c in t.columns if c.endswith("/plain_peak")]
    rows = [[r.model, r.batch_size, fmt(r.plain_ms), *[times(r[f"{m}/plain"]) for m in modes],
             *[times(r[c]) for c in peaks]] for _, r in t.iterrows()]
    header = ["model", "b", "plain SGD ms", *[f"{m} / plain" for m in modes],
              *[f"{c[:-len('/plain_peak')]} memory / plain" for c in peaks]]
    return (f"One whole training step, DP over plain SGD ({t['device'].iloc[0]}):\n\n"
            + markdown(rows, header))


def accounting_table(path):
    t = pd.read_csv(path)
    cols = [c for c in t.columns if c.endswith("_ms") and c != "target_ms"]
    rows = [[r.task, *[fmt(r[c]) for c in cols]] for _, r in t.iterrows()]
    return "Accountant speed, ms:\n\n" + markdown(rows, ["task", *cols])


TABLES = ("memory", "runtime", "e2e", "gpt", "training", "accounting")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--e2e", type=Path, default=ROOT / "bench-results" / "e2e.csv")
    parser.add_argument("--gpt", type=Path, default=ROOT / "bench-results" / "e2e_gpt.csv")
    parser.add_argument("--training", type=Path,
                        default=ROOT / "bench-results" / "training.csv")
    parser.add_argument("--accounting", type=Path,
                        default=ROOT / "bench-results" / "accounting.csv")
    parser.add_argument("--only", nargs="+", choices=TABLES, default=list(TABLES),
                        help="the tables to print, each under its own heading (default: all)")
    args = parser.parse_args(argv)
    made = {"memory": memory_table, "runtime": runtime_table,
            "e2e": lambda: args.e2e.is_file() and e2e_table(args.e2e),
            "gpt": lambda: args.gpt.is_file() and gpt_table(args.gpt),
            "training": lambda: args.training.is_file() and training_table(args.training),
            "accounting": lambda: args.accounting.is_file()
            and accounting_table(args.accounting)}
    parts = []
    for name in args.only:
        table = made[name]()
        if not table:  # (its CSV absent: say so, not a silent gap where a table was asked)
            print(f"{name}: no CSV (run `python -m workbench.bench {name}` first)",
                  file=sys.stderr)
            continue
        parts.append(f"<!-- results_tables.py --only {name} -->\n{table}")
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
