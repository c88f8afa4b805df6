"""What every explorer widget shares: wiring controls, showing errors, drawing to PNG.

A widget subclass builds ``self.controls`` (ipywidgets), a Figure and its Axes, then calls
``self._wire()``; its ``update()`` computes, draws with a ``viz.plot_*`` function and calls
``self._show_png()``. The figure is shown as a PNG image widget: no interactive matplotlib
backend is needed, in JupyterLab or headless.
"""

import io

import ipywidgets as widgets


class Explorer:
    """Mixin for the explorer widgets (``.controls``, ``.result``, ``.figure``, ``.widget``)."""

    def _wire(self) -> None:
        """Image and message widgets, observers on every control, the layout, a first draw."""
        self.image = widgets.Image(format="png")
        self.message = widgets.HTML()
        for control in self.controls.values():
            control.observe(lambda _: self.update(), names="value")
        self.widget = widgets.HBox([widgets.VBox([*self.controls.values(), self.message]),
                                    self.image])
        self.update()

    def _show_error(self, err: Exception) -> None:
        """Bad control values are shown in the widget, not raised."""
        self.message.value = f"<span style='color:#b00'>{err}</span>"

    def _show_png(self) -> None:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png")
        self.image.value = buffer.getvalue()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
