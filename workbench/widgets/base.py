"""What every explorer widget shares: wiring controls, showing errors, drawing to PNG.

A widget subclass builds ``self.controls`` (ipywidgets), a Figure and its Axes, then calls
``self._wire()``; its ``update()`` computes, draws with a ``viz.plot_*`` function and calls
``self._show_png()``. The figure is shown as a PNG image widget: no interactive matplotlib
backend is needed, in JupyterLab or headless.
"""

import io
import math

import ipywidgets as widgets

#: Every control's width: a slider track long enough to hit a value (about 300 px of track;
#: ~85 px made a 60 px drag move epochs from 60 to 1). Its readout can also be typed into.
CONTROL_LAYOUT = {"width": "440px"}


class Explorer:
    """Mixin for the explorer widgets (``.controls``, ``.result``, ``.figure``, ``.widget``)."""

    def _wire(self) -> None:
        """Image and message widgets, observers on every control, the layout, a first draw."""
        self.image = widgets.Image(format="png")
        self.message = widgets.HTML()
        for control in self.controls.values():
            control.layout = widgets.Layout(**CONTROL_LAYOUT)
            control.observe(lambda _: self.update(), names="value")
        self.widget = widgets.HBox([widgets.VBox([*self.controls.values(), self.message]),
                                    self.image])
        self.update()

    def _show_in_use(self, name: str, value) -> bool:
        """Put the value the result used into the disabled control ``name`` (a greyed slider
        must not show a value that is not in use), widening its range if needed. True when
        the control changed: its observer has then run update() again, with the same result,
        so the caller stops; False when nothing changed (the caller goes on drawing)."""
        control = self.controls[name]
        if control.value == value:
            return False
        log = isinstance(control, widgets.FloatLogSlider)  # its min and max are exponents
        position = math.log(value, control.base) if log and value > 0 else value
        if position > control.max:
            control.max = math.ceil(position) if log else position
        if position < control.min:
            control.min = math.floor(position) if log else position
        control.value = value
        return control.value == value

    def _show_error(self, err: Exception) -> None:
        """Bad control values are shown in the widget, not raised."""
        self.message.value = f"<span style='color:#b00'>{err}</span>"

    def _show_png(self) -> None:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png")
        self.image.value = buffer.getvalue()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


__all__ = ["CONTROL_LAYOUT", "Explorer"]
