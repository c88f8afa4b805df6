"""Training-step benchmark: ``python -m workbench.bench training``.

One optimizer step of the ordinary loop (zero_grad, forward, backward, step) on a digits
batch, plain SGD against the PrivacyEngine's DPOptimizer in every method
(interleaved medians). The DP step includes per-sample clipping, the noise draw and the
accountant's bookkeeping of the step. ``auto`` is make_private's default (``clipping/auto.py``:
einsum or book-keeping by a rule on the recorded layers); ``auto_chose`` says which it ran.
Zoo models (``--models imdb_embedding ...``) step on ``models.example_batch``. ``--opacus hooks
ghost`` adds Opacus' own loop in those modes (``bench.opacus_twin``), same model and batch.
"""

import sys

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench import models
from workbench.bench import opacus_twin
from workbench.bench.timing import (
    benchmark_parser,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.dpsgd import MODES

CANDIDATES = (*MODES, "auto")
DIGITS = ("digits_mlp", "digits_cnn")


def step_fn(model, optimizer, x, y):
    criterion = nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()

    return step


def bench(model_name, b, repeats, device, modes=CANDIDATES, opacus=()):
    if model_name in DIGITS:
        train_set, _ = wb.data.load_digits()
        x, y = (t[:b].to(device) for t in train_set.tensors)
    else:
        x, y = (t.to(device) for t in models.example_batch(
            model_name, b, generator=torch.Generator().manual_seed(0)))
    candidates = {}
    torch.manual_seed(0)
    plain = models.make_model(model_name).to(device)
    candidates["plain"] = step_fn(plain, torch.optim.SGD(plain.parameters(), lr=0.01), x, y)
    optimizers = []
    for mode in modes:
        torch.manual_seed(0)
        model = models.make_model(model_name).to(device)
        loader = DataLoader(TensorDataset(x, y), batch_size=b)
        _, opt, _ = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, method=mode)
        candidates[mode] = step_fn(model, opt, x, y)
        optimizers.append(opt)
    skipped = []
    for mode in opacus:  # Opacus' own loop on the same model and batch
        torch.manual_seed(0)
        step = opacus_twin.opacus_training_step(
            lambda: models.make_model(model_name).to(device), x, y, mode)
        try:
            step()
        except Exception as err:  # e.g. wb.layers.DPLSTM, which Opacus has no sampler for
            print(f"Opacus {mode} cannot run {model_name}: {type(err).__name__}: {err}",
                  file=sys.stderr)
            skipped.append(mode)
            continue
        candidates[f"opacus_{mode}"] = step
    times = time_interleaved(candidates, device, repeats=repeats)
    times.update({f"opacus_{mode}": float("nan") for mode in skipped})
    for opt in optimizers:
        opt.detach()
    row = {"model": model_name, "batch_size": b, "plain_ms": times["plain"] * 1e3}
    row.update({f"{m}/plain": times[m] / times["plain"] for m in modes})
    row.update({f"opacus_{m}/plain": times[f"opacus_{m}"] / times["plain"] for m in opacus})
    if "auto" in modes:
        row["auto_chose"] = optimizers[list(modes).index("auto")].last.get("mode")
    return row


def run(models=DIGITS, batch_sizes=(64, 256), repeats=5, device="cpu", modes=CANDIDATES,
        opacus=()) -> pd.DataFrame:
    """One ``bench`` row per (model, b), with the device."""
    device = torch.device(device)
    table = pd.DataFrame([bench(m, b, repeats, device, modes, opacus)
                          for m in models for b in batch_sizes])
    table["device"] = device_name(device)
    return table


def main(argv=None):
    parser = benchmark_parser("training", __doc__, batch_sizes=(64, 256))
    parser.add_argument("--models", nargs="+", default=list(DIGITS), choices=list(models.ZOO))
    parser.add_argument("--modes", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--opacus", nargs="*", default=[], choices=opacus_twin.OPACUS_MODES,
                        help="also time Opacus' own loop in these grad_sample_modes")
    args = parse_benchmark_args(parser, argv)
    table = run(args.models, args.batch_sizes, args.repeats, args.device, args.modes,
                args.opacus)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(f"device: {table['device'][0]}   one training step, plain in ms, DP as multiples")
    print(table.drop(columns="device").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0


__all__ = ["CANDIDATES", "DIGITS", "bench", "main", "run", "step_fn"]
