"""Memory benchmark: ``python -m workbench.bench memory``.

For each layer, width and batch size b, the peak memory of one forward + backward pass in
four modes, each measured on its own:

- ``plain``: Σ_i ℓ_i backward to the parameter gradients, no DP;
- ``einsum``: ``wb.clipped_grad_sum(method="einsum")``: the (b, *param) per-sample gradients
  are materialised, clipped and summed (what Opacus' GradSampleModule does);
- ``ghost`` and ``bookkeeping``: the clipped sum without materialising them (``clipping``).

**What is measured.** The bytes the step needs live before it starts (the layer's
parameters and buffers, the inputs and labels) plus the peak of what it allocates while it
runs: on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (less
what was allocated before), as in the Opacus paper's Table 3; on CPU (labelled "CPU
(profiler)" in every row) the peak of the running sum of the allocations and frees the torch
profiler records during the call (``profile_memory=True``). Both are *allocated* bytes, not
the allocator's reserve or the process' RSS.

**Opacus beside it.** When Opacus is installed (and unless ``--no-compare``), the mode
``opacus`` measures its ``GradSampleModule`` forward + backward (per-sample gradients, no
clipping; ``bench.opacus_twin``), the paper's "GSM(module)"; for the recurrent and attention
layers the module is Opacus' own DP layer.

**The model beside it.** The Opacus paper (Yousefpour et al. 2021, arXiv 2109.12298, §3.2.2,
Eq. 1-3) counts, per sample, C = the bytes of its features, label and output, and L = the
bytes of the trainable parameters:

    M_nonDP = bC + 2L              Eq. (1): data and output, parameters, their gradient
    M_DP    = bC + (1 + b)L        Eq. (2): the gradient becomes b per-sample gradients
    M_DP / M_nonDP ≈ 1 + L/C (L/C ≪ b),  b/3 (L/C ≈ b),  b/2 (L/C ≫ b)      Eq. (3)

For ghost clipping and book-keeping, which never hold bL, the workbench's model is

    M_ghost = bC + 2L + b·S,   S = Σ over layer calls of (backprop bytes kept for the norms
                                   + the norm route's scratch per sample)

with the scratch of each route (``clipping.ghost_routes``): 2 numbers for the norm product,
2T² for two (T, T) Grams, T·d for the embedding's segment sums, and the layer's own
per-sample gradient where it is materialised (fast gradient clipping, e.g. normalisation
layers). The paper found Eq. (3) off by -23% to +41% on a GPU, and Eq. (1)-(2) explaining
only 57% of the measured peak on average (its Fig. 3 and §3.2.3): intermediates are not in
the model. The ``*_error`` columns say by how much the predicted overhead factor differs
from the measured one here: (predicted - measured) / measured.

Layers and default widths follow ``bench layers`` (and ``bench dp_layers`` for the DP
recurrent and attention layers, measured through their DP twins in every mode). ``width``
is the one size the widget and ``--widths`` vary, which moves L/C: features for Linear,
channels for Conv2d, the vocabulary (num_embeddings, as in the paper's Fig. 3) for
Embedding, the normalised size for the norm layers, the hidden/embed size for the others.
"""

import contextlib
import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch import nn

import workbench as wb
from workbench.bench import opacus_twin
from workbench.bench.dp_layers import sum_of_products
from workbench.bench.timing import benchmark_parser, device_name, parse_benchmark_args
from workbench.clipping.ghost import record
from workbench.clipping.routes import layer_route
from workbench.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from workbench.models import RNNOutput, SelfAttention
from workbench.per_sample.memory import pooling

MODES = ("plain", "einsum", "ghost", "bookkeeping")
DP_MODES = MODES[1:]
ALL_MODES = (*MODES, "opacus")  # opacus: only where it is installed
BATCH_SIZES = (16, 32, 64, 128, 256, 512)
T = 32  # tokens / time steps per sample for the embedding, recurrent and attention layers


@dataclass(frozen=True)
class LayerSpec:
    """How to build a layer of a given width and a batch of b inputs for it."""

    make: object  # width -> nn.Module
    inputs: object  # (b, width, generator) -> tensor
    width: int  # default width (the one ``bench layers`` uses)
    widths: tuple  # the sweep of ``--widths all`` (L/C from small to large)
    what: str  # what ``width`` means for this layer


def _seq(cls):
    return lambda w: nn.Sequential(cls(w, w, batch_first=True), RNNOutput())


LAYERS = {
    "linear": LayerSpec(lambda w: nn.Linear(w, w), lambda b, w, g: torch.randn(b, w, generator=g),
                        512, (64, 512, 2048), "in = out features"),
    "conv2d": LayerSpec(lambda w: nn.Conv2d(w, w, 3, padding=1),
                        lambda b, w, g: torch.randn(b, w, 16, 16, generator=g),
                        32, (8, 32, 128), "in = out channels (16x16 images, 3x3 kernel)"),
    "embedding": LayerSpec(lambda w: nn.Embedding(w, 64),
                           lambda b, w, g: torch.randint(0, w, (b, T), generator=g),
                           20000, (100, 2000, 20000),
                           f"num_embeddings (dim 64, {T} tokens per sample)"),
    "layernorm": LayerSpec(lambda w: nn.LayerNorm(w),
                           lambda b, w, g: torch.randn(b, w, generator=g),
                           64, (64, 512, 4096), "normalised size"),
    "groupnorm": LayerSpec(lambda w: nn.GroupNorm(16, w),
                           lambda b, w, g: torch.randn(b, w, generator=g),
                           256, (64, 256, 1024), "channels (16 groups)"),
    "instancenorm": LayerSpec(lambda w: nn.InstanceNorm1d(w, affine=True),
                              lambda b, w, g: torch.randn(b, w, 64, generator=g),
                              256, (64, 256, 1024), "channels (length 64)"),
    "rnn": LayerSpec(_seq(DPRNN), lambda b, w, g: torch.randn(b, T, w, generator=g),
                     64, (16, 64, 256), f"input = hidden size ({T} steps)"),
    "gru": LayerSpec(_seq(DPGRU), lambda b, w, g: torch.randn(b, T, w, generator=g),
                     64, (16, 64, 256), f"input = hidden size ({T} steps)"),
    "lstm": LayerSpec(_seq(DPLSTM), lambda b, w, g: torch.randn(b, T, w, generator=g),
                      64, (16, 64, 256), f"input = hidden size ({T} steps)"),
    "mha": LayerSpec(lambda w: SelfAttention(DPMultiheadAttention(w, 4, batch_first=True)),
                     lambda b, w, g: torch.randn(b, T, w, generator=g),
                     64, (16, 64, 256), f"embed size (4 heads, {T} tokens)"),
}


def check_layer(name: str, width: int | None = None) -> LayerSpec:
    """The spec of ``name``; a clear error for an unknown layer or a width it cannot take."""
    if name not in LAYERS:
        raise ValueError(f"layer must be one of {sorted(LAYERS)}; got {name!r}")
    spec = LAYERS[name]
    if width is not None:
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive int; got {width!r}")
        if name in ("groupnorm", "mha") and width % (16 if name == "groupnorm" else 4):
            raise ValueError(f"width for {name} must be a multiple of "
                             f"{16 if name == 'groupnorm' else 4}; got {width}")
    return spec


# ---------------------------------------------------------------------------------------------
# Measuring


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C-level writes to stderr (the profiler prints start/stop lines there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_extra_peak(fn) -> int:
    """Peak of the running sum of CPU allocations minus frees during ``fn()``, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    return max(itertools.accumulate((nbytes for _, nbytes in events), initial=0))


def tensor_bytes(*objects) -> int:
    """Bytes of the tensors (or modules' parameters and buffers) given, each counted once."""
    seen, total = set(), 0
    for obj in objects:
        tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module) else [obj]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def peak_bytes(fn, device: torch.device, resident: int) -> int:
    """Peak allocated bytes while ``fn()`` runs: ``resident`` plus the peak of what it adds.

    ``resident`` is what the step needs live before it starts (e.g.
    ``tensor_bytes(layer, x, t)``: parameters, buffers, inputs, labels). What the call adds:
    on CUDA ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
    allocated before (so other tensors on the device do not count); on CPU the profiler's
    peak of allocations minus frees during the call. CPU buffer reuse is off while ``fn``
    runs (``per_sample.memory.pooling``): a buffer cached by an earlier call would otherwise
    not count as allocated, and the peak would hide it.
    """
    with pooling(False):
        return _peak_bytes(fn, device, resident)


def _peak_bytes(fn, device, resident):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return resident + torch.cuda.max_memory_allocated(device) - before
    return resident + _cpu_extra_peak(fn)


def steps(layer, x, t, max_grad_norm: float = 1.0) -> dict:
    """{mode: a callable running one forward + backward in that mode}."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def plain():
        return torch.autograd.grad(sum_of_products(layer(x), t).sum(), params)

    def dp(method):
        return lambda: wb.clipped_grad_sum(layer, sum_of_products, x, t, max_grad_norm,
                                           method=method)

    return {"plain": plain, **{m: dp(m) for m in DP_MODES}}


# ---------------------------------------------------------------------------------------------
# The model: Opacus' Eq. (1)-(3) and the ghost / book-keeping model


def ghost_scratch_bytes(layer, x, t) -> int:
    """S of the ghost model: per-sample bytes held for the norms, summed over layer calls."""
    rec = record(layer, sum_of_products, x[:2], t[:2], retain_graph=False)
    shared = rec.shared_ids()
    total = 0
    for _, module, call in rec.calls():
        b = call.backprops
        size = b.element_size()
        route, _ = layer_route(module, call, shared)
        own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        if route == "norm product":
            scratch = 2
        elif route == "gram":
            a = call.args[0]
            positions = (b[0].numel() // module.out_channels
                         if isinstance(module, nn.modules.conv._ConvNd)
                         else a[0].numel() // a.shape[-1])
            scratch = 2 * positions**2
        elif route == "segment sum":
            scratch = b[0].numel()  # T·d sums
        else:  # materialise, fast gradient clipping, bias only: the layer's own gradient
            scratch = own
        total += (b[0].numel() + scratch) * size
    return total


def layer_sizes(layer, x, t) -> dict:
    """L (trainable parameter bytes) and C (bytes per sample of input, label and output)."""
    with torch.no_grad():
        out = sum_of_products(layer(x), t)  # noqa: F841 (checks the shapes agree)
    n = x.shape[0]
    L = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    C = (x.numel() * x.element_size() + 2 * t.numel() * t.element_size()) / n
    return {"L_bytes": L, "C_bytes": C, "L/C": L / C}


def model_bytes(b: int, L: float, C: float, S: float = 0.0) -> dict:
    """Eq. (1), Eq. (2) and the ghost model, in bytes, for batch size b."""
    return {"plain": b * C + 2 * L,  # Eq. (1)
            "einsum": b * C + (1 + b) * L,  # Eq. (2)
            "ghost": b * C + 2 * L + b * S}


def eq3_regime(L_over_C: float, b: int) -> str:
    """Which case of Eq. (3) applies (within a factor 4)."""
    if L_over_C * 4 < b:
        return "L/C ≪ b: ≈ 1 + L/C"
    if L_over_C > 4 * b:
        return "L/C ≫ b: ≈ b/2"
    return "L/C ≈ b: ≈ b/3"


# ---------------------------------------------------------------------------------------------
# One row, a table


# Materialising modes hold about this many copies of the b·L per-sample gradients: the
# workbench's einsum step one, Opacus' GradSampleModule two (measured: its factor over plain
# is twice ours on Linear and Embedding). Used to skip steps that would not fit.
COPIES = {"einsum": 1, "opacus": 2}


def measure_layer(name: str, b: int, width: int | None = None, modes=MODES,
                  device: torch.device | str = "cpu", seed: int = 0,
                  max_GB: float = float("inf"), repeats: int = 1) -> dict:
    """One row: measured peak bytes per mode, the model's bytes, overheads and errors.

    A materialising mode whose per-sample gradients alone (``COPIES`` x b·L) would exceed
    ``max_GB`` is not run; its columns are NaN. Each mode is measured ``repeats`` times after
    a warm-up, and the largest peak is kept.
    """
    spec = check_layer(name, width)
    width = spec.width if width is None else width
    device = torch.device(device)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    layer = spec.make(width).to(device)
    x = spec.inputs(b, width, g).to(device)
    with torch.no_grad():
        t = torch.randn(layer(x).shape, generator=g).to(device)
    sizes = layer_sizes(layer, x, t)
    S = ghost_scratch_bytes(layer, x, t)
    resident = {mode: tensor_bytes(layer, x, t) for mode in ALL_MODES}
    run = steps(layer, x, t)
    if "opacus" in modes:
        twin = opacus_twin.opacus_layer(name, width, layer).to(device)
        run["opacus"] = opacus_twin.gsm_step(twin, sum_of_products, x, t)
        resident["opacus"] = tensor_bytes(twin, x, t)
    row = {"layer": name, "width": width, "batch_size": b, **sizes, "ghost_S_bytes": S}
    requested = [m for m in modes if m != "plain"]
    modes = ("plain", *[m for m in requested  # plain: the overheads' baseline
                        if COPIES.get(m, 0) * b * sizes["L_bytes"] <= max_GB * 2**30])
    for mode in modes:
        run[mode]()  # warm-up: one-off caches are not the step's memory
        row[f"{mode}_MB"] = max(peak_bytes(run[mode], device, resident[mode])
                                for _ in range(repeats)) / 2**20
    predicted = model_bytes(b, sizes["L_bytes"], sizes["C_bytes"], S)
    row["model_plain_MB"] = predicted["plain"] / 2**20
    row["model_plain_explains"] = row["model_plain_MB"] / row["plain_MB"]
    for mode in requested:  # the model even where a step was skipped as too large
        if mode in modes:
            row[f"{mode}_x"] = row[f"{mode}_MB"] / row["plain_MB"]
        if mode == "opacus":
            continue
        key = "ghost" if mode == "bookkeeping" else mode
        row[f"model_{mode}_x"] = predicted[key] / predicted["plain"]
        if mode in modes:
            row[f"{mode}_error"] = row[f"model_{mode}_x"] / row[f"{mode}_x"] - 1
    row["eq3_regime"] = eq3_regime(sizes["L/C"], b)
    row["device"] = device_name(device) if device.type == "cuda" else (
        f"CPU (profiler) {device_name(device)}")
    return row


def run(layers, batch_sizes, widths="default", modes=MODES, device="cpu", progress=None,
        max_GB=float("inf"), repeats=1):
    """A DataFrame with one ``measure_layer`` row per (layer, width, b)."""
    device = torch.device(device)
    jobs = [(name, w, b) for name in layers
            for w in (LAYERS[name].widths if widths == "all" else [LAYERS[name].width])
            for b in batch_sizes]
    rows = []
    for name, w, b in jobs:
        rows.append(measure_layer(name, b, w, modes, device, max_GB=max_GB, repeats=repeats))
        if progress:
            progress(name, w, b)
    table = pd.DataFrame(rows)
    table["torch"] = torch.__version__
    table["date"] = pd.Timestamp.now(tz="UTC").strftime("%Y-%m-%d")
    return table


def extra_memory(table: pd.DataFrame) -> pd.DataFrame:
    """Measured extra MB over plain beside the models' extra terms, per row.

    The models' *extra* terms, (b - 1)L for einsum (Eq. 2 - Eq. 1) and bS for ghost, do not
    depend on what Eq. (1) leaves out (intermediates), so they can be compared directly.
    """
    b, MB = table["batch_size"], 2**20
    out = table[["layer", "width", "batch_size", "L/C"]].copy()
    out["einsum extra MB"] = table["einsum_MB"] - table["plain_MB"]
    out["(b-1)L MB"] = (b - 1) * table["L_bytes"] / MB
    out["ghost extra MB"] = table["ghost_MB"] - table["plain_MB"]
    out["bS MB"] = b * table["ghost_S_bytes"] / MB
    return out


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per layer: measured vs predicted overhead at the largest batch size, mean errors."""
    rows = []
    for (name, width), part in table.groupby(["layer", "width"], sort=False):
        last = part.loc[part["batch_size"].idxmax()]
        row = {"layer": name, "width": width, "L/C": last["L/C"], "b": last["batch_size"]}
        for mode in DP_MODES:
            if f"{mode}_x" in part:
                row[f"{mode} x"] = last[f"{mode}_x"]
                row[f"model {mode} x"] = last[f"model_{mode}_x"]
                row[f"{mode} mean error"] = part[f"{mode}_error"].mean()
        if "opacus_x" in part:
            row["opacus x"] = last["opacus_x"]
        row["Eq.1 explains"] = part["model_plain_explains"].mean()
        rows.append(row)
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame) -> str:
    cols = ["layer", "width", "batch_size", "L/C", "plain_MB", "einsum_x", "model_einsum_x",
            "opacus_x", "ghost_x", "bookkeeping_x", "model_ghost_x"]
    return table[[c for c in cols if c in table]].to_string(
        index=False, float_format=lambda v: f"{v:.3g}")


def main(argv=None):
    parser = benchmark_parser("memory", __doc__, batch_sizes=BATCH_SIZES)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES)
    parser.add_argument("--no-compare", action="store_true",
                        help="skip Opacus' GradSampleModule even when Opacus is installed")
    parser.set_defaults(repeats=1)  # allocation is deterministic: one measurement suffices
    for action in parser._actions:  # the shared option means something else here
        if action.dest == "repeats":
            action.help = "measurements per mode after a warm-up; the largest peak is kept"
    parser.add_argument("--max-GB", type=float, default=12.0,
                        help="skip materialising modes whose per-sample gradients alone would "
                             "exceed this (their columns are then empty)")
    parser.add_argument("--widths", choices=["default", "all"], default="default",
                        help="'all' sweeps each layer's widths (L/C from small to large, "
                             "as the paper's Fig. 3 does for the embedding)")
    args = parse_benchmark_args(parser, argv)
    device = torch.device(args.device)
    modes = [m for m in args.modes if m != "opacus"]
    if not args.no_compare and (opacus_twin.available() or "opacus" in args.modes):
        modes.append("opacus")
    table = run(args.layers, args.batch_sizes, args.widths, modes, device,
                progress=lambda *job: print("measured", *job, file=sys.stderr, flush=True),
                max_GB=args.max_GB, repeats=args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(f"device: {table['device'][0]}   torch {torch.__version__}   peak allocated memory; "
          f"*_x = overhead factor over plain, model_* = Eq. (1)-(2) / ghost model")
    print(format_table(table))
    print()
    print("Summary (largest batch size; errors = predicted / measured overhead - 1, averaged "
          "over batch sizes; the paper: Eq. (3) off by -23% to +41%)")
    print(summary(table).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if {"einsum_MB", "ghost_MB"} <= set(table.columns):
        extra = extra_memory(table)
        print()
        print("Extra memory over plain at the largest batch size, beside the models' extra "
              "terms ((b-1)L: Eq. 2 - Eq. 1; bS: ghost)")
        print(extra[extra["batch_size"] == extra["batch_size"].max()].to_string(
            index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {args.out}")
    return 0


SHIPPED_DIR = Path(__file__).resolve().parents[2] / "data" / "bench"


def source_label(table: pd.DataFrame) -> str:
    """A short name for a measured table: its device and date, e.g. "NVIDIA H200 · 2026-11-23".

    CPU rows name the processor and thread count ("CPU (profiler) CPU x86_64 x2 threads"); the
    label keeps the thread count ("CPU, 2 threads"), short enough for a button.
    """
    device = str(table["device"].iloc[0]).removeprefix("CPU (profiler) ")
    threads = re.search(r"x(\d+) threads", device)
    if device.startswith("CPU") and threads:
        device = f"CPU, {threads.group(1)} threads"
    date = table["date"].iloc[0] if "date" in table else "undated"
    return f"{device} · {date}"


def shipped_results() -> dict[str, Path]:
    """{label: path} of the memory CSVs shipped under ``data/bench/`` (``source_label``)."""
    return {source_label(load(path)): path
            for path in sorted(SHIPPED_DIR.glob("memory_*.csv"))}


@dataclass
class MemoryResult:
    """Predicted and measured memory overheads of one layer at one width, against b.

    ``model_*`` are Eq. (2)/(1) and the ghost model over ``batch_sizes``; ``measured`` has a
    row per measured batch size (columns ``batch_size``, ``einsum_x``, ``ghost_x``,
    ``bookkeeping_x``, ``plain_MB``); ``at_b`` is the row at ``batch_size`` if measured.
    """

    layer: str
    width: int
    batch_size: int
    what: str
    L_bytes: float
    C_bytes: float
    S_bytes: float
    batch_sizes: tuple
    model_einsum: list
    model_ghost: list
    measured: pd.DataFrame
    source: str

    @property
    def L_over_C(self) -> float:
        return self.L_bytes / self.C_bytes

    @property
    def at_b(self) -> dict | None:
        rows = self.measured[self.measured["batch_size"] == self.batch_size]
        return None if rows.empty else rows.iloc[-1].to_dict()

    def predicted(self, mode: str, b: int | None = None) -> float:
        """The model's overhead factor of ``mode`` (einsum, ghost, bookkeeping) at b."""
        m = model_bytes(self.batch_size if b is None else b, self.L_bytes, self.C_bytes,
                        self.S_bytes)
        return m["einsum" if mode == "einsum" else "ghost"] / m["plain"]


def layer_constants(name: str, width: int) -> dict:
    """L, C (bytes) and the ghost model's S (bytes per sample) of a layer at a width."""
    spec = check_layer(name, width)
    g = torch.Generator().manual_seed(0)
    layer = spec.make(width)
    x = spec.inputs(2, width, g)
    with torch.no_grad():
        t = torch.randn(layer(x).shape, generator=g)
    sizes = layer_sizes(layer, x, t)
    return {"L_bytes": sizes["L_bytes"], "C_bytes": sizes["C_bytes"],
            "S_bytes": ghost_scratch_bytes(layer, x, t)}


def explore_memory(layer: str, width: int, batch_size: int, measurements: pd.DataFrame,
                   source: str, batch_sizes=BATCH_SIZES) -> MemoryResult:
    """The widget's compute step: the model over ``batch_sizes`` beside ``measurements``.

    ``measurements`` is a table in this benchmark's format (live rows or a shipped CSV); the
    rows of this layer and width are kept.
    """
    spec = check_layer(layer, width)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    k = layer_constants(layer, width)
    bs = tuple(sorted({*batch_sizes, batch_size}))
    model = [model_bytes(b, k["L_bytes"], k["C_bytes"], k["S_bytes"]) for b in bs]
    if measurements.empty:  # nothing measured yet: the model alone
        measurements = pd.DataFrame(columns=["layer", "width", "batch_size"])
    rows = measurements[(measurements["layer"] == layer) & (measurements["width"] == width)]
    return MemoryResult(layer, width, batch_size, spec.what, k["L_bytes"], k["C_bytes"],
                        k["S_bytes"], bs, [m["einsum"] / m["plain"] for m in model],
                        [m["ghost"] / m["plain"] for m in model],
                        rows.sort_values("batch_size").reset_index(drop=True), source)


def load(path: str | Path) -> pd.DataFrame:
    """A memory CSV written by this benchmark (e.g. one shipped under ``data/bench/``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"memory results {str(path)!r} not found; write one with "
                                f"python -m workbench.bench memory --out {path}")
    table = pd.read_csv(path)
    missing = {"layer", "width", "batch_size", "plain_MB", "device"} - set(table.columns)
    if missing:
        raise ValueError(f"{path} is not a memory benchmark CSV: columns {sorted(missing)} "
                         f"are missing")
    return table
