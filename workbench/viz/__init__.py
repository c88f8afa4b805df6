"""Plots: ``plot_*(ax, result)`` functions that draw a compute function's result on given axes.

Matplotlib only, no widgets. Each draws on the axes it is handed and returns its artists; none
creates a figure or calls ``plt.show()`` (ARCHITECTURE.md, style item 7).
"""


__all__: list[str] = []
