"""Interactive widgets: thin ipywidgets glue, controls -> compute -> plot.

Each widget exposes ``.controls`` (a dict of ipywidgets) and ``.result`` (the last compute
result), so tests can set values from code and check what changed (ARCHITECTURE.md, style item 7).
"""


__all__: list[str] = []
