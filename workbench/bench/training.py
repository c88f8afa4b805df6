"""Training-step benchmark: ``python -m workbench.bench training``.

One optimizer step of the ordinary loop (zero_grad, forward, backward, step) on a digits
batch, plain SGD against the PrivacyEngine's DPOptimizer in every method
(interleaved medians). The DP step includes per-sample clipping, the noise draw and the
accountant's bookkeeping of the step. ``auto`` is make_private's default (``clipping/auto.py``:
einsum or book-keeping by a rule on the recorded layers); ``auto_chose`` says which it ran.
Zoo models (``--models imdb_embedding ...``) step on ``models.example_batch``. ``--opacus hooks
ghost`` adds Opacus' own loop in those modes (``bench.opacus_twin``), same model and batch.
``--models tiny_gpt``: the character GPT at T = 128 (``bench.gpt``'s model and batch).
Each MODE column runs the optimizer as ``make_private`` returns it, so with
``DPOptimizer.skip_weight_grads`` at its default (from the first step the user's backward
skips the weight gradients the DP step recomputes, ``dpsgd/skip_weights.py``);
``--keep-weight-grads`` adds MODE+grads with it off (autograd's weight gradients computed too);
``--memory`` the peak allocated bytes of one step over plain's (``bench.peak_memory``).
"""

import sys

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench import models
from workbench.bench import opacus_twin
from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.bench.timing import (
    benchmark_parser,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.dpsgd import MODES

CANDIDATES = (*MODES, "auto")
DIGITS = ("digits_mlp", "digits_cnn")


def sequence_mean(logits, y):
    """tiny_gpt's loss: the mean over sequences of the per-sequence mean token loss."""
    return models.sequence_cross_entropy(logits, y).mean()


def build(model_name, b, device):
    """(model, x, y, criterion) on ``device``; tiny_gpt: V = 96, T = 128 (``bench.gpt``)."""
    torch.manual_seed(0)
    if model_name == "tiny_gpt":
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 96, (b, 128), generator=gen).to(device) for _ in range(2))
        return models.tiny_gpt(96, block_size=128, generator=torch.Generator().manual_seed(0)
                               ).to(device), x, y, sequence_mean
    if model_name in DIGITS:
        train_set, _ = wb.data.load_digits()
        x, y = (t[:b].to(device) for t in train_set.tensors)
    else:
        x, y = (t.to(device) for t in models.example_batch(
            model_name, b, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    return models.make_model(model_name).to(device), x, y, nn.CrossEntropyLoss()


def step_fn(model, optimizer, x, y, criterion=None):
    criterion = criterion or nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()

    return step


def bench(model_name, b, repeats, device, modes=CANDIDATES, opacus=(), keep=False,
          memory=False):
    candidates, optimizers, models_of = {}, [], {}
    plain, x, y, criterion = build(model_name, b, device)
    candidates["plain"] = step_fn(plain, torch.optim.SGD(plain.parameters(), lr=0.01), x, y,
                                  criterion)
    models_of["plain"] = plain
    runs = [*modes, *[f"{m}+grads" for m in modes if keep]]  # +grads: skip_weight_grads off
    for mode in runs:
        model = build(model_name, b, device)[0]
        loader = DataLoader(TensorDataset(x, y), batch_size=b)
        _, opt, _ = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            method=mode.removesuffix("+grads"))
        if mode.endswith("+grads"):
            opt.skip_weight_grads = False  # else the default, as a user gets it
        opt.recorder.watch.owned = False  # a step timed on one fixed batch, no loader's: no
        # training run, no ε claimed (a loop would take each step's batch from the loader)
        candidates[mode] = step_fn(model, opt, x, y, criterion)
        optimizers.append(opt)
        models_of[mode] = model
    skipped = []
    for mode in opacus:  # Opacus' own loop on the same model and batch
        torch.manual_seed(0)
        try:  # the same model and loss as ours (build), tiny_gpt's included
            step = opacus_twin.opacus_training_step(
                lambda: build(model_name, len(x), device)[0], x, y, mode, criterion=criterion)
            step()
        except Exception as err:  # e.g. wb.layers.DPLSTM, which Opacus has no sampler for
            print(f"Opacus {mode} cannot run {model_name}: {type(err).__name__}: {err}",
                  file=sys.stderr)
            skipped.append(mode)
            continue
        candidates[f"opacus_{mode}"] = step
    times = time_interleaved(candidates, device, repeats=repeats)
    peaks = {k: peak_bytes(fn, device, tensor_bytes(models_of[k], x, y))
             for k, fn in candidates.items() if k in models_of} if memory else {}
    times.update({f"opacus_{mode}": float("nan") for mode in skipped})
    for opt in optimizers:
        opt.detach()
    row = {"model": model_name, "batch_size": b, "plain_ms": times["plain"] * 1e3}
    row.update({f"{m}/plain": times[m] / times["plain"] for m in runs})
    row.update({f"opacus_{m}/plain": times[f"opacus_{m}"] / times["plain"] for m in opacus})
    row.update({f"{m}/plain_peak": peaks[m] / peaks["plain"] for m in runs if peaks})
    if "auto" in modes:
        row["auto_chose"] = optimizers[list(modes).index("auto")].last.get("mode")
    return row


def run(models=DIGITS, batch_sizes=(64, 256), repeats=5, device="cpu", modes=CANDIDATES,
        opacus=(), keep=False, memory=False) -> pd.DataFrame:
    """One ``bench`` row per (model, b), with the device."""
    device = torch.device(device)
    table = pd.DataFrame([bench(m, b, repeats, device, modes, opacus, keep, memory)
                          for m in models for b in batch_sizes])
    table["device"] = device_name(device)
    return table


def main(argv=None):
    parser = benchmark_parser("training", __doc__, batch_sizes=(64, 256))
    parser.add_argument("--models", nargs="+", default=list(DIGITS),
                        choices=[*models.ZOO, "tiny_gpt"])
    parser.add_argument("--modes", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--opacus", nargs="*", default=[], choices=opacus_twin.OPACUS_MODES,
                        help="also time Opacus' own loop in these grad_sample_modes")
    parser.add_argument("--keep-weight-grads", action="store_true",
                        help="also time each mode with DPOptimizer.skip_weight_grads off "
                             "(columns MODE+grads/plain; the MODE columns use its default)")
    parser.add_argument("--memory", action="store_true",
                        help="also the peak allocated bytes of one step over plain's "
                             "(columns MODE/plain_peak; bench.peak_memory)")
    args = parse_benchmark_args(parser, argv)
    table = run(args.models, args.batch_sizes, args.repeats, args.device, args.modes,
                args.opacus, args.keep_weight_grads, args.memory)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(f"device: {table['device'][0]}   one training step, plain in ms, DP as multiples")
    print(table.drop(columns="device").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0


__all__ = ["CANDIDATES", "DIGITS", "bench", "main", "run", "step_fn"]
