"""The embedding's ghost norms against PyTorch's embedding backward:
``python -m workbench.bench embedding_norm``.

Issue 19's target: the norm sampler (``rules/embedding.py``) does no O(V) work and
costs at most 1.3x PyTorch's own embedding backward (the weight gradient of Σ_t o_t·b_t, which
zeroes a (V, d) tensor and adds the n T rows into it) at b = 256, T = 32, Embedding(20000, 64).
Both are timed side by side, interleaved (``timing.time_interleaved``), in ``--runs`` separate
runs, so that the spread between runs shows too.
"""

import pandas as pd
import torch
from torch import nn

from workbench.bench.timing import (
    benchmark_parser,
    device_name,
    parse_benchmark_args,
    time_interleaved,
)
from workbench.rules.embedding import embedding_norm_sampler


def bench(b: int, T: int, V: int, d: int, repeats: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Embedding(V, d).to(device)
    x = torch.randint(0, V, (b, T), generator=g).to(device)
    backprops = torch.randn(b, T, d, generator=g).to(device)
    out = layer(x)
    times = time_interleaved({
        "torch_backward": lambda: torch.autograd.grad(out, layer.weight, backprops,
                                                      retain_graph=True),
        "ghost_norms": lambda: embedding_norm_sampler(layer, (x,), backprops)}, device, repeats)
    return {"batch_size": b, "T": T, "V": V, "d": d, **times,
            "ghost/torch": times["ghost_norms"] / times["torch_backward"]}


def run(batch_sizes=(256,), repeats=40, device="cpu", runs=5, vocab=20000) -> pd.DataFrame:
    """``runs`` separate interleaved ``bench`` rows per b (T = 32, d = 64), with the device."""
    device = torch.device(device)
    table = pd.DataFrame([{"run": r, **bench(b, 32, vocab, 64, repeats, device)}
                          for b in batch_sizes for r in range(runs)])
    table["device"] = device_name(device)
    return table


def main(argv=None):
    parser = benchmark_parser("embedding_norm", __doc__, batch_sizes=(256,))
    parser.set_defaults(repeats=40)
    parser.add_argument("--runs", type=int, default=5, help="separate interleaved runs")
    parser.add_argument("--vocab", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parse_benchmark_args(parser, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    table = run(args.batch_sizes, args.repeats, args.device, args.runs, args.vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(f"device: {table['device'][0]}   times in ms; target ghost/torch <= 1.3")
    shown = table.assign(torch_backward=table["torch_backward"] * 1e3,
                         ghost_norms=table["ghost_norms"] * 1e3)
    print(shown.drop(columns="device").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0


__all__ = ["bench", "main", "run"]
