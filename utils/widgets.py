"""Interactive explorers for notebooks that are safe to run headless.

``ipywidgets.interactive`` (and ``interact``) show their function's output in
an ``Output`` widget. A headless runner that imitates that widget's front end
(nbclient, under papermill and ``jupyter nbconvert --execute``) writes back to
the kernel while it waits for the cell's reply, and that can hide the reply
from it: the cell then waits for its timeout, or forever without one
(jupyter/nbclient#312; ``utils.course.runner`` explains the mechanism). The course's
explorers use no ``Output`` widget: the report is text in an ``HTML`` widget,
replaced when a control moves, so nothing is captured and no runner has
anything to imitate.
"""

from __future__ import annotations

import html
from typing import Any, Callable

__all__ = ["explorer"]


def explorer(report: Callable[..., str], **controls: Any):
    """Controls and a text panel showing ``report(**values)``, live in Jupyter.

    Args:
        report: a function of the controls' values (by keyword) returning the
            text to show; it should be quick, since it runs on every change.
        **controls: ipywidgets value widgets (``IntSlider``, ``Dropdown``, ...),
            by the keyword ``report`` takes them under.

    Returns:
        An ``ipywidgets.VBox`` to ``display``: the controls, then the report as
        preformatted text. ``.report_panel`` is the text widget and
        ``.refresh()`` recomputes it (both for tests and for code that changes
        a control's value).

    Raises:
        ValueError: no controls, or a control that is not a value widget.
    """
    import ipywidgets as widgets

    if not controls:
        raise ValueError("explorer needs at least one control, e.g. batch=widgets.IntSlider(...)")
    for name, control in controls.items():
        if not isinstance(control, widgets.ValueWidget):
            raise ValueError(f"control {name!r} is a {type(control).__name__}, not an ipywidgets "
                             "value widget (IntSlider, FloatSlider, Dropdown, ...)")
    panel = widgets.HTML()

    def refresh(_change: Any = None) -> None:
        try:
            text = report(**{name: c.value for name, c in controls.items()})
        except Exception as exc:  # noqa: BLE001 - show the error in the panel, keep the widget alive
            text = f"{type(exc).__name__}: {exc}"
        panel.value = f"<pre style='margin: 0.3em 0'>{html.escape(str(text))}</pre>"

    for control in controls.values():
        control.observe(refresh, names="value")
    refresh()
    box = widgets.VBox([*controls.values(), panel])
    box.report_panel = panel
    box.refresh = refresh
    return box
