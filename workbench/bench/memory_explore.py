"""The memory widget's compute: the memory model over b beside a measured table.

``explore_memory(layer, width, batch_size, measurements, source)`` returns a
``MemoryResult``: the layer's L and C (bytes) and the ghost model's S (``clipping.
memory_model``), the predicted overhead factors of Eq. (2)/(1) and of the ghost model over a
range of batch sizes, and the measured rows of that layer and width. ``viz.memory.
plot_memory`` draws it; ``widgets.memory.MemoryExplorer`` is the glue. The measurements are a
table in the format ``python -m workbench.bench memory`` writes, live or one of the CSVs
shipped under ``data/bench/`` (``shipped_results``, ``load``).

Notation: b batch size, L parameter bytes, C bytes per sample (features, label, output),
S ghost bytes per sample.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from workbench.bench.layer_specs import check_layer, make_case
from workbench.bench.memory import BATCH_SIZES, ghost_S
from workbench.clipping.memory_model import layer_sizes, model_bytes
from workbench.data import bundled

SHIPPED_DIR = bundled("bench")  # data/bench/: package data (importlib.resources)


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
    """{label: path} of the memory CSVs shipped in ``data/bench/``
    (``source_label``)."""
    return {source_label(load(path)): path
            for path in sorted(SHIPPED_DIR.glob("memory_*.csv"))}


def load(path: str | Path) -> pd.DataFrame:
    """A memory CSV written by the benchmark (e.g. one shipped under ``data/bench/``)."""
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
    layer, x, t = make_case(name, 2, width)
    sizes = layer_sizes(layer, x, t)
    return {"L_bytes": sizes["L_bytes"], "C_bytes": sizes["C_bytes"],
            "S_bytes": ghost_S(layer, x, t)}


def explore_memory(layer: str, width: int, batch_size: int, measurements: pd.DataFrame,
                   source: str, batch_sizes=BATCH_SIZES) -> MemoryResult:
    """The widget's compute step: the model over ``batch_sizes`` beside ``measurements``.

    ``measurements`` is a table in the benchmark's format (live rows or a shipped CSV); the
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


__all__ = [
    "SHIPPED_DIR", "MemoryResult", "explore_memory", "layer_constants", "load", "shipped_results",
    "source_label",
]
