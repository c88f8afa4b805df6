"""DP layers benchmark: ``python -m workbench.bench dp_layers``.

For DPRNN, DPGRU, DPLSTM and DPMultiheadAttention and each batch size b, one run measures
side by side (interleaved medians, ``timing.time_interleaved``), with the same weights:

- ``torch``: forward + backward of Σ_i ℓ_i through the torch.nn layer (fused kernels);
- ``dp``: the same through the DP layer, without per-sample gradients;
- ``dp_einsum``: ``wb.per_sample_gradients(..., method="einsum")`` through the DP layer;
- ``opacus`` (when Opacus is installed, unless ``--no-compare``): Opacus' own DP layer in its
  GradSampleModule, forward + backward (the paper's "GSM(DPModule)").

``dp/torch`` is the price of hookable parts; ``einsum/dp`` the price of the per-sample
gradients on top, part of which is only writing them: ``floor`` is the time to write the
(b, *param) per-sample tensors into fresh memory at the copy bandwidth measured in the same
run (``timing.copy_bandwidth``, as in ``python -m workbench.bench layers``). The Opacus
paper measured up to 11x and ~2x for these on a GPU (Yousefpour et al. 2021, arXiv
2109.12298, §E.2, Fig. 5 and Table 2); the workbench's targets on CPU are dp/torch <= 2 and
einsum/dp <= 1.5. Sizes: T = 32 steps, input and hidden size 64; attention is self-attention
with embed_dim 64 and 4 heads over 32 tokens, ``need_weights=False``.

Ratios are what to compare across machines; absolute times only with the device named
(every row records it). Shared CPUs are noisy: ``--threads 1`` and more ``--repeats`` steady
the ratios.
"""


import pandas as pd
import torch
from torch import nn

import workbench as wb
from workbench.bench import opacus_twin
from workbench.bench.layer_specs import T
from workbench.bench.steps import plain_step, sum_of_products
from workbench.bench.timing import (
    benchmark_parser,
    copy_bandwidth,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from workbench.models import RNNOutput, SelfAttention

D = 64  # input / hidden / embed size; T (time steps, tokens) as in bench.layer_specs

LAYERS = {  # name -> (torch.nn layer factory, DP twin, one-input wrapper)
    "rnn": (lambda: nn.RNN(D, D, batch_first=True), DPRNN,
            lambda layer: nn.Sequential(layer, RNNOutput())),
    "gru": (lambda: nn.GRU(D, D, batch_first=True), DPGRU,
            lambda layer: nn.Sequential(layer, RNNOutput())),
    "lstm": (lambda: nn.LSTM(D, D, batch_first=True), DPLSTM,
             lambda layer: nn.Sequential(layer, RNNOutput())),
    "mha": (lambda: nn.MultiheadAttention(D, 4, batch_first=True), DPMultiheadAttention,
            SelfAttention),
}


def bench_layer(name, b, repeats, device, bandwidth=None, seed=0, compare=False):
    """One row per (layer, b): median seconds per candidate and the ratios.

    ``bandwidth`` (bytes/s into fresh memory) adds the ``floor`` columns when given;
    ``compare`` adds Opacus' DP layer in its GradSampleModule (``bench.opacus_twin``).
    """
    make_torch, dp_class, wrap = LAYERS[name]
    torch.manual_seed(seed)
    reference = make_torch().to(device)
    torch_model = wrap(reference)
    dp_model = wrap(dp_class.from_torch(reference))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, D, generator=g).to(device)
    t = torch.randn(b, T, D, generator=g).to(device)
    candidates = {
        "torch": lambda: plain_step(torch_model, x, t),
        "dp": lambda: plain_step(dp_model, x, t),
        "dp_einsum": lambda: wb.per_sample_gradients(dp_model, sum_of_products, x, t,
                                                     method="einsum"),
    }
    if compare:
        twin = opacus_twin.opacus_layer(name, D, reference).to(device)
        candidates["opacus"] = opacus_twin.gsm_step(twin, sum_of_products, x, t)
    times = time_interleaved(candidates, device, repeats=repeats)
    row = {"layer": name, "batch_size": b, "T": T, "size": D,
           "params": sum(p.numel() for p in reference.parameters()), **times}
    row["dp/torch"] = times["dp"] / times["torch"]
    row["einsum/dp"] = times["dp_einsum"] / times["dp"]
    row["einsum/torch"] = times["dp_einsum"] / times["torch"]
    if compare:
        row["opacus/einsum"] = times["opacus"] / times["dp_einsum"]
    if bandwidth:
        nbytes = sum(b * p.numel() * p.element_size() for p in reference.parameters())
        row["per_sample_MB"], row["floor"] = nbytes / 2**20, nbytes / bandwidth
        row["einsum/(dp+floor)"] = times["dp_einsum"] / (times["dp"] + row["floor"])
    return row


def run(layers, batch_sizes, repeats, device, compare=False):
    bandwidth = copy_bandwidth(device, fresh=True)
    table = pd.DataFrame([bench_layer(name, b, repeats, device, bandwidth, compare=compare)
                          for name in layers for b in batch_sizes])
    table["device"] = device_name(device)
    table["torch_version"] = torch.__version__
    return table


def report(table: pd.DataFrame) -> str:
    """What ``main`` prints: the device, the targets and the table."""
    return (f"device: {table['device'][0]}   torch {torch.__version__}   times in ms   "
            f"targets: dp/torch <= 2, einsum/dp <= 1.5\n" + format_table(table))


def format_table(table: pd.DataFrame) -> str:
    ms = [c for c in ("torch", "dp", "dp_einsum", "floor", "opacus") if c in table]
    ratios = [c for c in ("dp/torch", "einsum/dp", "einsum/torch", "einsum/(dp+floor)",
                          "opacus/einsum") if c in table]
    shown = table[["layer", "batch_size", *ms, *ratios]].copy()
    shown[ms] = shown[ms] * 1e3
    return shown.to_string(index=False, float_format=lambda v: f"{v:.3g}")


def main(argv=None):
    parser = benchmark_parser("dp_layers", __doc__)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--no-compare", action="store_true",
                        help="skip Opacus' DP layers even when Opacus is installed")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    args = parse_benchmark_args(parser, argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1; got {args.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        table = run(args.layers, args.batch_sizes, args.repeats, torch.device(args.device),
                    compare=opacus_twin.available() and not args.no_compare)
    finally:
        torch.set_num_threads(threads)  # leave an in-process caller as it was
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(report(table))
    print(f"wrote {args.out}")
    return 0


__all__ = ["D", "LAYERS", "bench_layer", "format_table", "main", "report", "run"]
