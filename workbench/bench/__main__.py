"""Command line entry: ``python -m workbench.bench NAME [options]``.

Each benchmark lives in its own module with a ``main(argv)`` function; this file only
dispatches, so ``python -m workbench.bench NAME --help`` shows that benchmark's options.
"""

import argparse
import importlib
import sys

BENCHMARKS = {
    "layers": ("workbench.bench.layers", "per-layer per-sample gradient runtime"),
    "e2e": ("workbench.bench.e2e", "one clipped-sum step of the Fast-DPSGD models"),
    "accounting": ("workbench.bench.accounting", "privacy accountant speed"),
    "training": ("workbench.bench.training", "a DP-SGD training step against plain SGD"),
    "dp_layers": ("workbench.bench.dp_layers", "DP RNN/GRU/LSTM/attention vs torch.nn"),
    "memory": ("workbench.bench.memory", "peak memory per layer and DP mode"),
    "embedding_norm": ("workbench.bench.embedding_norm",
                       "embedding ghost norms vs PyTorch's embedding backward"),
    "selfcheck": ("workbench.bench.selfcheck", "the self-check's cost: checked vs unchecked"),
    "imports": ("workbench.bench.imports", "what import workbench costs over import torch"),
    "real": ("workbench.bench.real", "the real-architecture table: exact per method, cost, "
                                     "Opacus' verdict"),
    "all": ("workbench.bench.all", "every benchmark, CSVs and Fig. 2/3-style figures"),
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        parser = argparse.ArgumentParser(
            prog="python -m workbench.bench",
            description="Benchmarks of the DP-SGD workbench. Choose one: "
            + ", ".join(f"{k} ({v[1]})" for k, v in BENCHMARKS.items()),
        )
        parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
        parser.parse_args(argv[:1])  # prints help or a clear error, then exits
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
