"""The real-architecture table: exact or refused per method, and one DP step's cost.

For each model of ``workbench.realzoo`` (tiny configs, random weights: GPT-2 ... MobileNetV3),
side by side:

- **verdicts** (float64, n = T = 5 tokens or 3 images): every method of the functional API
  (per-sample gradients by micro-batching / vmap / einsum; clipped sums by ghost and
  book-keeping) against the independent one-sample-at-a-time loop of
  ``realzoo.reference``: "exact" (within 1e-9 relative), "wrong: <parameter> ...", or
  "refused: <error>" (a ``WorkbenchError`` naming what and why);
- **Opacus 1.6's verdict** on the same batch: ``GradSampleModule`` (hooks) per-sample
  gradients against the same loop: exact / wrong / "raised: <error>";
- **cost** (float32, n = 16): one DP-optimizer step in the default mode (``method="auto"``,
  or ``--mode``: zero_grad, forward, backward, step) over one plain SGD step (zero_grad,
  forward, backward, step): interleaved medians (``bench.timing``) and peak allocated bytes
  (``bench.peak_memory``) of a later step, and the peak of the first, self-checked step
  (``memory_first_x``: the record probe's extra passes), at two sizes of each architecture
  (``realzoo/sizes.py``): **tiny** (the verdicts' models, T = 8), where a plain step is a
  few milliseconds of Python dispatch and the ratio measures the DP step's fixed per-call
  costs, and **base** (hidden 256, 2 layers, T = 64; images 32 x 32 at 4x the widths), where
  arithmetic is what a step is made of (columns ``*_base``). ``--sizes`` picks.

**Threads.** On CPU the table runs with one intra-op thread (``--threads 1``, the default):
the models are tiny (width 16-32, 16x16 images), so there is nothing for a second thread to
split, and on a shared machine OpenMP's worker threads wait for a core that another process
holds: with 2 threads on a 2-core machine under load ~6, one plain step of the tiny Qwen2
took 15-1060 ms (BERT 8-780 ms), which made single ratios of 0.2x-21x; with 1 thread, 8-34
ms. ``--threads 0`` keeps PyTorch's default.

Run: ``python -m workbench.bench real [--models gpt2 llama ...] [--repeats 5] [--threads 1]
[--mode bookkeeping] [--out PATH]``.
"""

import argparse
import copy
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import workbench as wb
from workbench.bench import opacus_twin
from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.bench.timing import device_name, time_interleaved
from workbench.dpsgd import MODES, DPOptimizer
from workbench.errors import WorkbenchError
from workbench.outputs import output_file_arg
from workbench.realzoo import PROBLEMS, sizes
from workbench.realzoo.reference import clipped_sum, norms_of, one_at_a_time, scale, verdict

VERDICT_N, T_CHECK = 5, 5  # n = T: the layout shapes cannot tell apart
TIME_N = 16  # T: sizes.TOKENS (8 tiny: within every tiny config's 16 positions; 64 base)


def short(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:90]}" if str(error) else \
        type(error).__name__


def attempt(fn):
    """fn()'s verdict string: its own, or "refused: ..." / "crashed: ..." when it raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except WorkbenchError as error:
        return "refused: " + short(error)
    except Exception as error:  # noqa: BLE001  (a crash that is not a clear error: reported)
        return "crashed: " + short(error)


def verdicts(name: str, device: torch.device = torch.device("cpu")) -> dict:
    """{method: verdict} for the functional API and Opacus, float64, on ``device`` (the
    reference loop too: on a GPU the table says whether the methods are exact there)."""
    problem = PROBLEMS[name]
    model, loss_fn = problem.build(torch.float64).to(device), problem.loss_fn
    x, y = (t.to(device) for t in problem.batch(VERDICT_N, T=T_CHECK))
    ref = attempt(lambda: one_at_a_time(model, loss_fn, x, y))
    if isinstance(ref, str):  # the model itself cannot run per sample (BatchNorm in eval: can)
        return {m: ref for m in ("microbatch", "vmap", "einsum", "ghost", "bookkeeping")}
    size, C = scale(ref), float(norms_of(ref).median())
    want = clipped_sum(ref, C)
    out = {}
    for method in ("microbatch", "vmap", "einsum"):
        out[method] = attempt(lambda: verdict(wb.per_sample_gradients(
            model, loss_fn, x, y, method=method), ref, size, problem.rtol))
    for method in ("ghost", "bookkeeping"):
        out[method] = attempt(lambda: verdict(wb.clipped_grad_sum(
            model, loss_fn, x, y, C, method=method), want, size, problem.rtol))
    out["opacus"] = opacus_verdict(model, loss_fn, x, y, ref, size, problem.rtol)
    return out


def opacus_verdict(model, loss_fn, x, y, ref, size, rtol) -> str:
    if not opacus_twin.available():
        return "not installed"

    def run():
        from opacus import GradSampleModule

        gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
        loss_fn(gsm(x), y).sum().backward()
        got = {k.removeprefix("_module."): p.grad_sample for k, p in gsm.named_parameters()
               if p.requires_grad and p.grad_sample is not None}
        return verdict(got, ref, size, rtol)

    result = attempt(run)
    return result.replace("refused: ", "raised: ").replace("crashed: ", "raised: ")


def cost(name: str, repeats: int, device: torch.device, size: str = "tiny",
         mode: str = "auto") -> dict:
    """One DP step in ``mode`` over one plain SGD step: time and peak memory, float32, at
    ``size`` (``realzoo/sizes.py``), and the first (self-checked) DP step's peak; the columns
    of "base" end in ``_base``."""
    with sizes.size(size):
        problem = PROBLEMS[name]
        x, y = (t.to(device) for t in problem.batch(TIME_N, T=sizes.TOKENS[size],
                                                    dtype=torch.float32))
        plain_model = problem.build(torch.float32).to(device)
    end = "" if size == "tiny" else f"_{size}"
    dp_model = copy.deepcopy(plain_model)
    plain_opt = torch.optim.SGD([p for p in plain_model.parameters() if p.requires_grad], lr=1e-3)
    dp_opt = DPOptimizer(torch.optim.SGD([p for p in dp_model.parameters() if p.requires_grad],
                                         lr=1e-3), dp_model,
                         noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=TIME_N,
                         loss_reduction="sum", method=mode)

    def step(model, opt):
        def run():
            opt.zero_grad()
            problem.loss_fn(model(x), y).sum().backward()
            opt.step()
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resident = tensor_bytes(plain_model, x, y)
        first = peak_bytes(step(dp_model, dp_opt), device, resident)  # self-checked: not the
        # steady state, timed apart
        times = time_interleaved({"plain": step(plain_model, plain_opt),
                                  "dp": step(dp_model, dp_opt)}, device, repeats=repeats)
        peak = {k: peak_bytes(step(m, o), device, resident)
                for k, (m, o) in {"plain": (plain_model, plain_opt),
                                  "dp": (dp_model, dp_opt)}.items()}
    dp_opt.detach()
    return {f"plain_ms{end}": 1e3 * times["plain"], f"time_x{end}": times["dp"] / times["plain"],
            f"memory_x{end}": peak["dp"] / peak["plain"],
            f"memory_first_x{end}": first / peak["plain"]}


def row(name: str, repeats: int, device: torch.device, sizes_=("tiny", "base"),
        mode: str = "auto") -> dict:
    out = {"model": name, **verdicts(name, device)}
    for size in sizes_:
        end = "" if size == "tiny" else f"_{size}"
        dp = (sizes.NO_BASE[name] if size == "base" and name in sizes.NO_BASE
              else attempt(lambda s=size: cost(name, repeats, device, s, mode)))
        out.update(dp if isinstance(dp, dict) else {
            f"time_x{end}": float("nan"), f"memory_x{end}": float("nan"),
            f"memory_first_x{end}": float("nan"), f"cost_note{end}": dp})
    return out


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m workbench.bench real",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS),
                        metavar="NAME", help=f"from: {', '.join(PROBLEMS)}")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op CPU threads (0: PyTorch's default; see the docstring)")
    parser.add_argument("--sizes", nargs="+", default=list(sizes.SIZES), choices=sizes.SIZES,
                        help="the sizes the DP step's cost is measured at (realzoo/sizes.py)")
    parser.add_argument("--mode", default="auto", choices=[*MODES, "auto"],
                        help="the DP optimizer's method for the cost columns (default: auto)")
    parser.add_argument("--out", type=output_file_arg("--out"),
                        default=Path("bench-results/real.csv"), help="CSV of the table")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0 (0: PyTorch's default); got {args.threads}")
    return args


def brief(cell) -> str:
    """A verdict cell for the printed table: "exact", "wrong", or "refused (ErrorType)"."""
    if not isinstance(cell, str) or ":" not in cell:
        return cell
    head, rest = cell.split(":", 1)
    return head if head == "wrong" else f"{head} ({rest.split(':')[0].strip()})"


def printable(table: pd.DataFrame) -> pd.DataFrame:
    out = table.drop(columns=[c for c in table
                              if c.startswith("cost_note") or c == "device"]).copy()
    for column in ("microbatch", "vmap", "einsum", "ghost", "bookkeeping", "opacus"):
        out[column] = out[column].map(brief)
    return out.round({c: 1 if c.startswith("plain_ms") else 2 for c in out
                      if c.startswith(("plain_ms", "time_x", "memory_x", "memory_first_x"))})


def summary(table: pd.DataFrame, mode: str = "auto") -> str:
    methods = ["microbatch", "vmap", "einsum", "ghost", "bookkeeping"]
    cells = table[methods].stack()
    count = {k: int(cells.str.startswith(k).sum()) for k in ("exact", "refused", "wrong",
                                                              "crashed")}
    opacus = table["opacus"].str.split(":").str[0].value_counts().to_dict()
    costs = []
    for size in sizes.SIZES:
        end = "" if size == "tiny" else f"_{size}"
        if f"time_x{end}" in table:
            t, m = table[f"time_x{end}"], table[f"memory_x{end}"]
            first = table.get(f"memory_first_x{end}", pd.Series(dtype=float))
            costs.append(f"{size}: median {t.median():.2f}x time ({worst(table, t)}), median "
                         f"{m.median():.2f}x memory ({worst(table, m)}), first step "
                         f"{first.median():.2f}x memory ({worst(table, first)})")
    how = "default mode" if mode == "auto" else f"mode {mode}"
    return (f"workbench: {count['exact']} exact, {count['refused']} refused with a clear error, "
            f"{count['wrong']} wrong, {count['crashed']} unclear crashes of {len(cells)}; "
            f"opacus: {opacus}; DP step over plain ({how}), {'; '.join(costs)}")


def worst(table: pd.DataFrame, column: pd.Series) -> str:
    """"worst <x>, <model>" of a cost column ("worst -" when it has no number)."""
    values = column.to_numpy(dtype=float)
    if not column.notna().any():
        return "worst -"
    at = int(np.nanargmax(values))  # by position: a table concatenated from halves repeats
    return f"worst {values[at]:.2f}x, {table['model'].to_numpy()[at]}"  # its index


def main(argv=None):
    args = parse(argv)  # --out is checked while parsing (workbench/outputs.py)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        rows = []
        for name in args.models:
            rows.append(row(name, args.repeats, device, args.sizes, args.mode))
            pd.DataFrame(rows).to_csv(args.out, index=False)  # so far: a run stopped early
            print(f"{name}: done", flush=True)  # keeps the rows it finished
        where = device_name(device)  # with the threads the table ran on
    finally:
        torch.set_num_threads(threads)  # main() called from a notebook leaves it as it was
    table = pd.DataFrame(rows)
    table["device"] = where  # the CSV names its machine, as every bench CSV does
    with pd.option_context("display.width", 250):
        print(f"\n{where}, DP step: n = {TIME_N}, T = {sizes.TOKENS['tiny']} (tiny) and "
              f"{sizes.TOKENS['base']} (base), float32; "
              f"verdicts: n = T = {VERDICT_N}, float64 on {device.type}\n"
              f"{printable(table).to_string(index=False)}\n\n{summary(table, args.mode)}")
    table.to_csv(args.out, index=False)
    print(f"wrote {args.out} (full verdicts and errors)")
    return 0


__all__ = [
    "attempt", "brief", "cost", "main", "opacus_verdict", "parse", "printable", "row", "short",
    "summary", "verdicts", "worst",
]
