"""End-to-end benchmark of one clipped-sum step: ``python -m workbench.bench e2e``.

For the Fast-DPSGD models of the Opacus paper's Table 1 (Yousefpour et al. 2021, arXiv
2109.12298; Subramani, Vadivelu, Kamath 2021, arXiv 2010.09063) at each batch size, one run
measures side by side (interleaved medians):

- ``plain``: a non-private forward + backward of the mean loss (parameter gradients);
- each ``method`` of ``wb.clipped_grad_sum``: the clipped per-sample gradient sum that a
  DP-SGD step adds noise to (microbatch, vmap, einsum materialise; ghost and bookkeeping
  do not).

``--models tiny_gpt tiny_gpt_10x`` adds the transformer rows of ``bench/gpt.py`` (sequence
length ``--seq-len``): full fine-tuning and LoRA, each method against its own plain step.

It reports ratios to plain and the peak allocated memory of each candidate, measured as
``python -m workbench.bench memory`` measures it (``bench.peak_memory.peak_bytes``): on CUDA
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, on CPU the bytes live
before plus the torch profiler's peak of allocations minus frees.
"""

import sys

import pandas as pd
import torch
from torch import nn

import workbench as wb
from workbench import models
from workbench.bench.gpt import SIZES as GPT_SIZES
from workbench.bench.gpt import bench_tiny_gpt
from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.bench.steps import plain_step
from workbench.bench.timing import (
    benchmark_parser,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.clipping import CLIP_METHODS

DEFAULT_MODELS = [m for m in ("mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm")
                  if m in models.ZOO]
LOSS = nn.CrossEntropyLoss(reduction="none")


def bench_model(name, b, methods, repeats, device, max_grad_norm=1.0):
    model = models.make_model(name).to(device)
    x, y = models.example_batch(name, b, generator=torch.Generator().manual_seed(0))
    x, y = x.to(device), y.to(device)
    candidates = {"plain": lambda: plain_step(model, x, y, LOSS, torch.mean)}
    for method in methods:
        candidates[method] = (lambda m=method: wb.clipped_grad_sum(
            model, LOSS, x, y, max_grad_norm=max_grad_norm, method=m))
    times = time_interleaved(candidates, device, repeats=repeats)
    row = {"model": name, "batch_size": b, "params": models.count_parameters(model)}
    for cand, t in times.items():
        row[f"{cand}_ms"] = t * 1e3
        if cand != "plain":
            row[f"{cand}/plain"] = t / times["plain"]
    resident = tensor_bytes(model, x, y)
    for cand, fn in candidates.items():  # peak allocated bytes (bench.peak_memory: CUDA or CPU)
        row[f"{cand}_peak_MB"] = peak_bytes(fn, device, resident) / 2**20
    for cand in candidates:
        if cand != "plain":
            row[f"{cand}_mem/plain"] = row[f"{cand}_peak_MB"] / row["plain_peak_MB"]
    return row


def run(models=DEFAULT_MODELS, batch_sizes=(64, 256), methods=CLIP_METHODS, repeats=5,
        device="cpu", seq_len=128, progress=None) -> pd.DataFrame:
    """One row per (model, b): ``bench_model``, or ``bench_tiny_gpt`` for the GPT sizes."""
    device = torch.device(device)
    rows = []
    for m in models:
        for b in batch_sizes:
            if m in GPT_SIZES:
                rows.append(bench_tiny_gpt(m, b, seq_len, methods, repeats, device))
            else:
                rows.append(bench_model(m, b, methods, repeats, device))
            if progress:
                progress(m, b)
    table = pd.DataFrame(rows)
    table["device"] = device_name(device)
    table["torch"] = torch.__version__
    return table


def report(table: pd.DataFrame) -> str:
    """What ``main`` prints: plain in ms, the other candidates as multiples of plain."""
    ratios = [c for c in table.columns if c.endswith(("/plain", "/lora_plain"))]
    shown = table[["model", "batch_size", "plain_ms", *ratios]]
    text = (f"device: {table['device'][0]}   torch {torch.__version__}   "
            f"(plain in ms, the others as multiples of plain)\n"
            + shown.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    audits = [c for c in table.columns if c.endswith(("_audit", "_worst"))]
    if audits:  # the tiny_gpt rows: per-sample gradients against micro-batching (float64)
        rows = table.dropna(subset=audits, how="all")[["model", *audits]]
        text += "\nper-sample gradients vs micro-batching (float64):\n" + "\n".join(
            f"  {r['model']} {c.removesuffix('_audit')}: {r[c]}, worst {r[c[:-6] + '_worst']}"
            for _, r in rows.iterrows() for c in audits if c.endswith("_audit"))
    return text


def main(argv=None):
    parser = benchmark_parser("e2e", __doc__, batch_sizes=(64, 256))
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                        choices=[*models.ZOO, *GPT_SIZES])
    parser.add_argument("--methods", nargs="+", default=list(CLIP_METHODS), choices=CLIP_METHODS)
    parser.add_argument("--seq-len", type=int, default=128, help="T of the tiny_gpt rows")
    args = parse_benchmark_args(parser, argv)
    table = run(args.models, args.batch_sizes, args.methods, args.repeats, args.device,
                args.seq_len, progress=lambda *job: print("measured", *job, file=sys.stderr,
                                                          flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(report(table))
    print(f"wrote {args.out}")
    return 0


__all__ = ["DEFAULT_MODELS", "LOSS", "bench_model", "main", "report", "run"]
