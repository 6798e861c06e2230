"""utils.explorer: live in Jupyter, nothing for a headless runner to wait on."""

import ipywidgets as widgets
import pytest

import utils


def test_the_report_follows_the_controls():
    batch = widgets.IntSlider(value=4, min=1, max=64)
    d = widgets.Dropdown(options=[8, 16], value=8)
    box = utils.explorer(lambda batch, d: f"batch {batch} x d {d} = {batch * d}", batch=batch, d=d)
    assert "batch 4 x d 8 = 32" in box.report_panel.value
    batch.value = 10
    assert "batch 10 x d 8 = 80" in box.report_panel.value
    d.value = 16
    assert "batch 10 x d 16 = 160" in box.report_panel.value
    assert box.children[:2] == (batch, d)


def test_no_output_widget_and_text_is_escaped():
    box = utils.explorer(lambda n: f"<b>{n}</b> & more", n=widgets.IntSlider(value=1))
    assert not any(isinstance(w, widgets.Output) for w in box.children)
    assert "&lt;b&gt;1&lt;/b&gt; &amp; more" in box.report_panel.value


def test_a_failing_report_shows_its_error_in_the_panel():
    box = utils.explorer(lambda n: f"{1 / n:.2f}", n=widgets.IntSlider(value=1, min=0, max=4))
    box.children[0].value = 0
    assert "ZeroDivisionError" in box.report_panel.value
    box.children[0].value = 4
    assert "0.25" in box.report_panel.value


def test_bad_controls_are_clear_errors():
    with pytest.raises(ValueError, match="at least one control"):
        utils.explorer(lambda: "x")
    with pytest.raises(ValueError, match="'n' is a Button, not an ipywidgets value widget"):
        utils.explorer(lambda n: "x", n=widgets.Button())
