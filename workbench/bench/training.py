"""Training-step benchmark: ``python -m workbench.bench training``.

One optimizer step of the ordinary loop (zero_grad, forward, backward, step) on a digits
batch, plain SGD against the PrivacyEngine's DPOptimizer in every grad_sample_mode
(interleaved medians). The DP step includes per-sample clipping, the noise draw and the
accountant's bookkeeping of the step.
"""

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.bench.timing import (
    benchmark_parser,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.dpsgd import MODES


def step_fn(model, optimizer, x, y):
    criterion = nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()

    return step


def bench(model_name, b, repeats, device):
    train_set, _ = wb.data.load_digits()
    x, y = (t[:b].to(device) for t in train_set.tensors)
    candidates = {}
    torch.manual_seed(0)
    plain = getattr(wb.models, model_name)().to(device)
    candidates["plain"] = step_fn(plain, torch.optim.SGD(plain.parameters(), lr=0.01), x, y)
    optimizers = []
    for mode in MODES:
        torch.manual_seed(0)
        model = getattr(wb.models, model_name)().to(device)
        loader = DataLoader(TensorDataset(x, y), batch_size=b)
        _, opt, _ = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode)
        candidates[mode] = step_fn(model, opt, x, y)
        optimizers.append(opt)
    times = time_interleaved(candidates, device, repeats=repeats)
    for opt in optimizers:
        opt.detach()
    row = {"model": model_name, "batch_size": b, "plain_ms": times["plain"] * 1e3}
    row.update({f"{m}/plain": times[m] / times["plain"] for m in MODES})
    return row


def run(models=("digits_mlp", "digits_cnn"), batch_sizes=(64, 256), repeats=5,
        device="cpu") -> pd.DataFrame:
    """One ``bench`` row per (model, b), with the device."""
    device = torch.device(device)
    table = pd.DataFrame([bench(m, b, repeats, device) for m in models for b in batch_sizes])
    table["device"] = device_name(device)
    return table


def main(argv=None):
    parser = benchmark_parser("training", __doc__, batch_sizes=(64, 256))
    parser.add_argument("--models", nargs="+", default=["digits_mlp", "digits_cnn"],
                        choices=["digits_mlp", "digits_cnn"])
    args = parse_benchmark_args(parser, argv)
    table = run(args.models, args.batch_sizes, args.repeats, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(f"device: {table['device'][0]}   one training step, plain in ms, DP as multiples")
    print(table.drop(columns="device").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0
