"""Plots of memory (and runtime) overhead factors against the batch size.

- ``plot_memory(ax, result)``: one layer at one width (a ``bench.memory_explore.MemoryResult``): the
  Opacus paper's model for materialised per-sample gradients (Eq. 2 over Eq. 1) and the
  workbench's ghost model as lines, the measured factors as markers, the chosen b marked.
- ``plot_overheads(ax, table, column)``: one line per layer, in the style of the paper's
  Fig. 2 (Yousefpour et al. 2021, arXiv 2109.12298): overhead factor against batch size.
- ``plot_sweep(ax, table, layer)``: one layer at several widths, measured (solid) and
  predicted (dashed), in the style of the paper's Fig. 3 (the embedding at several L/C).

Notation: b batch size, L parameter bytes, C bytes per sample (features, label, output).
"""

from matplotlib.ticker import NullLocator

from workbench.viz.clipping import plain_log_ticks

MODE_STYLE = {"einsum": ("C0", "o", "einsum (materialised)"),
              "ghost": ("C2", "s", "ghost clipping"),
              "bookkeeping": ("C1", "^", "book-keeping")}


def _log_axes(ax, xlabel: str, ylabel: str, batch_sizes=None, log_y=True) -> None:
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    if batch_sizes is not None:  # label the batch sizes themselves: 16, 32, ..., not 2^4
        ax.set_xticks(sorted(set(batch_sizes)), [str(b) for b in sorted(set(batch_sizes))])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, which="both")


def plot_memory(ax, result):
    """Draw predicted (lines) and measured (markers) overheads of one layer; returns artists.

    Keys: "model_einsum", "model_ghost" (Line2D), "measured_<mode>" for each measured mode,
    "b" (the chosen batch size), "legend". Does not clear ``ax`` or create a figure.
    """
    r = result
    artists = {
        "model_einsum": ax.plot(r.batch_sizes, r.model_einsum, color="C0", linestyle="--",
                                label="model: Eq. (2) / Eq. (1)")[0],
        "model_ghost": ax.plot(r.batch_sizes, r.model_ghost, color="C2", linestyle="--",
                               label="model: ghost / book-keeping")[0],
        "b": ax.axvline(r.batch_size, color="k", linestyle=":", linewidth=1),
    }
    values = [*r.model_einsum, *r.model_ghost, 1.0]
    for mode, (color, marker, label) in MODE_STYLE.items():
        column = f"{mode}_x"
        if column in r.measured and len(r.measured):
            artists[f"measured_{mode}"] = ax.plot(
                r.measured["batch_size"], r.measured[column], color=color, marker=marker,
                linestyle="-", markersize=5, label=f"measured: {label}")[0]
            values += list(r.measured[column])
    _log_axes(ax, "batch size b", "peak memory / plain", r.batch_sizes)
    ax.set_ylim(min(values) / 1.3, max(values) * 1.3)
    ax.set_title(f"{r.layer}, {r.what} = {r.width}: L/C = {r.L_over_C:.3g}   [{r.source}]",
                 fontsize="small")
    artists["legend"] = ax.legend(loc="upper left", fontsize="small")
    return artists


def plot_overheads(ax, table, column: str, ylabel: str = "overhead factor", layers=None,
                   log_y=True):
    """One line per layer of ``table[column]`` against ``batch_size``; returns {layer: Line2D}.

    Rows of several widths per layer: the first width in the table is used. ``log_y=False``
    suits factors that stay within a few units (ghost clipping).
    """
    lines = {}
    for i, (name, part) in enumerate(table.groupby("layer", sort=False)):
        if layers is not None and name not in layers:
            continue
        if "width" in part:
            part = part[part["width"] == part["width"].iloc[0]]
        part = part.sort_values("batch_size")
        lines[name] = ax.plot(part["batch_size"], part[column], marker="o", markersize=3,
                              color=f"C{i % 10}", label=name)[0]
    _log_axes(ax, "batch size b", ylabel, table["batch_size"], log_y)
    ax.legend(fontsize="x-small", ncol=2)
    return lines


def plot_sweep(ax, table, layer: str = "embedding", mode: str = "einsum"):
    """``layer`` at each width in ``table``: measured (solid) and model (dashed) overheads."""
    lines = {}
    part = table[table["layer"] == layer]
    for i, (width, rows) in enumerate(part.groupby("width")):
        rows = rows.sort_values("batch_size")
        label = f"{width} (L/C = {rows['L/C'].iloc[0]:.3g})"
        lines[width] = ax.plot(rows["batch_size"], rows[f"{mode}_x"], marker="o", markersize=3,
                               color=f"C{i}", label=label)[0]
        ax.plot(rows["batch_size"], rows[f"model_{mode}_x"], linestyle="--", color=f"C{i}")
    _log_axes(ax, "batch size b", f"peak memory / plain ({mode})", part["batch_size"])
    ax.legend(title=f"{layer} width (dashed: model)", fontsize="x-small",
              title_fontsize="x-small")
    return lines


__all__ = ["MODE_STYLE", "plot_memory", "plot_overheads", "plot_sweep"]
