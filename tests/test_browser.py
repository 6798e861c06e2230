"""What a learner sees: course notebooks run in JupyterLab, in a real (headless) browser.

papermill and nbval run kernels and never look at the page, so a widget that does not
render, a figure that does not load or a progress bar printed as escape codes passes
them. Here JupyterLab is served from the repository (a free localhost port, a token,
``COURSE_SMOKE=1``), Debian's Chromium opens each notebook below through Playwright,
the Run menu's "Run All Cells" runs it, and once the kernel is idle the rendered page
is checked: every cell ran, no error output, the environment printout is there, every
figure is an image of non-zero size, tqdm progress bars are widgets (not text), every
ipywidgets control renders and, when moved, changes the report the kernel writes next
to it. Screenshots of each notebook go to the test's tmp_path (``pytest -m browser -rP``
prints where). A notebook built to fail every check (tests/fixtures/browser/) proves
that each check can fail.

One JupyterLab server and one browser per pytest worker that runs these tests (ports,
tokens and Jupyter folders of their own); each notebook's kernel is shut down after its
test, and the server, with everything it started, after the last test of this file.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

import browser_lab as bl
from conftest import REPO, course_notebooks


def _nb(relpath: str, *shows: str):
    """A line of NOTEBOOKS: the notebook and what it must show at least once."""
    return pytest.param(relpath, frozenset(shows), id=relpath.removesuffix(".ipynb"))


# One line per notebook: the notebook, then what it must show at least once at smoke size on
# a CPU ("figures", "progress bars": tqdm widgets, "controls": ipywidgets; some notebooks'
# bars run only on a GPU). One notebook per module, chosen for what it shows and for its
# speed at smoke size on a 2-core CPU.
NOTEBOOKS = [
    _nb("00-foundations/05_rooflines_and_mfu.ipynb", "figures", "progress bars", "controls"),
    _nb("01-torch-compile/02_graph_breaks.ipynb", "figures", "progress bars"),
    _nb("02-mixed-precision/03_grad_scaler.ipynb", "figures", "progress bars"),
    _nb("03-fused-operations/01_fewer_bigger_kernels.ipynb", "figures", "progress bars"),
    _nb("04-memory-efficiency/01_anatomy_of_training_memory.ipynb", "figures"),
    _nb("05-distributed/08_resharding_and_async_save.ipynb", "figures"),
    _nb("06-capstone/01_speedup_ladder.ipynb", "figures", "progress bars"),
]
# Modules being written now: give each a line above once it has notebooks, and take it
# out of here. A module with notebooks that is in neither place fails a test below.
NOT_YET_COVERED: set[str] = set()
BROKEN = "tests/fixtures/browser/broken_page.ipynb"

# A smoke-size notebook finishes in one to three minutes here; this only bounds a hang.
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def chromium():
    path = bl.find_chromium()
    if path is None:
        pytest.skip(bl.missing_chromium_reason())
    return path


@pytest.fixture(scope="module")
def lab(chromium, tmp_path_factory):
    """One JupyterLab server per pytest worker, stopped with everything it started.

    Module scope: the server and the browser go as soon as this file's tests are done,
    and a process left behind fails a browser test's teardown, not some later test's."""
    server = bl.start_lab(REPO, tmp_path_factory.mktemp("jupyterlab"),
                          env={"COURSE_SMOKE": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    yield server
    left = bl.stop_lab(server)
    assert not left, f"processes left running after JupyterLab stopped: {left}"


@pytest.fixture(scope="module")
def browser(chromium):
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed: pip install -e \".[dev]\"")
    pw = sync_api.sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=list(bl.CHROMIUM_ARGS))
    except Exception:
        pw.stop()
        raise
    yield browser
    browser.close()
    pw.stop()


@pytest.fixture(scope="module")
def browser_context(browser):
    """One browser context per worker: JupyterLab's scripts load once, then come from its cache."""
    context = browser.new_context(viewport=bl.VIEWPORT)
    context.set_default_timeout(60_000)
    yield context
    context.close()


@pytest.fixture
def page(browser_context, lab):
    page = browser_context.new_page()
    yield page
    page.close()


def _run(page, lab, relpath):
    """Open, Run All, wait until idle; return (cells as the page shows them, seconds)."""
    notebook = REPO / relpath
    start = time.monotonic()
    bl.open_notebook(page, lab, relpath)
    print(f"{relpath}: opened, kernel idle after {time.monotonic() - start:.1f} s")
    bl.run_all_cells(page)

    def describe(i):
        cells = bl.read_page(page, notebook)
        return cells[i].name() if i is not None and i < len(cells) else f"code cell {i}"

    try:
        seconds = bl.wait_until_done(page, RUN_TIMEOUT_S, describe)
        return bl.read_page(page, notebook), seconds
    finally:
        lab.remember_children()


def _finish(page, lab, relpath, tmp_path):
    """Screenshots of the whole notebook to tmp_path, then shut its kernel down."""
    shots = bl.screenshot_notebook(page, tmp_path / relpath.replace("/", "__").removesuffix(".ipynb"))
    bl.shutdown_kernels(lab, relpath)
    return shots


@pytest.mark.browser
@pytest.mark.notebook
@pytest.mark.parametrize(("relpath", "shows"), NOTEBOOKS)
def test_notebook_in_jupyterlab(relpath, shows, page, lab, tmp_path):
    """Run All in JupyterLab, then check the page as a learner sees it."""
    notebook = REPO / relpath
    shots = []
    try:
        cells, seconds = _run(page, lab, relpath)
        problems = bl.find_problems(cells, shows)
        start = time.monotonic()
        controls = bl.exercise_controls(page)
        print(f"{relpath}: {len(controls)} controls moved in {time.monotonic() - start:.1f} s")
    finally:
        start = time.monotonic()
        shots = _finish(page, lab, relpath, tmp_path)
        print(f"{relpath}: screenshots and kernel shutdown in {time.monotonic() - start:.1f} s")
        print(f"{relpath}: screenshots: {', '.join(str(s) for s in shots)}")
    print(f"{relpath}: ran all {len(cells)} code cells in {seconds:.1f} s (Run All to idle)")
    for c in controls:
        print(f"  control {c.describe()}")
    problems += [f"control {c.describe()}" for c in controls if not c.report_changed]
    assert not problems, (f"{relpath} in JupyterLab:\n  " + "\n  ".join(problems)
                          + f"\nscreenshots: {', '.join(str(s) for s in shots)}")
    # Committed notebooks have no outputs; a JupyterLab save (autosave is off) would add them.
    saved = nbformat.read(notebook, as_version=4)
    assert not any(c.get("outputs") for c in saved.cells if c.cell_type == "code"), \
        f"the browser run saved outputs into {relpath} (JupyterLab's autosave must be off)"


@pytest.mark.browser
@pytest.mark.notebook
def test_every_check_can_fail(page, lab, tmp_path):
    """The negative control: a notebook that breaks each check, and each check says so."""
    try:
        cells, _ = _run(page, lab, BROKEN)
        problems = bl.find_problems(cells, frozenset({"figures", "progress bars", "controls"}))
        # The real explorer answers within a second or two; 5 s tells a dead one apart.
        controls = bl.exercise_controls(page, timeout_s=5)
    finally:
        shots = _finish(page, lab, BROKEN, tmp_path)
        print(f"{BROKEN}: screenshots: {', '.join(str(s) for s in shots)}")
    text = "\n".join(problems)
    expected = {
        "no environment printout": "no environment printout",
        "tqdm's text bar": "a progress bar printed as text",
        "a broken image": "an image that did not render",
        "a widget with no model": "a widget that did not render",
        "the error in the last cell": "error output: ValueError: the browser test must see this error",
        "no progress widget": "should show progress bars",
    }
    missed = [what for what, needle in expected.items() if needle not in text]
    assert not missed, f"checks that did not fire on {', '.join(missed)}; found:\n{text}"
    assert not any("did not run" in p for p in problems), problems  # the error is the last cell
    [explorer] = controls
    assert explorer.kind == "slider" and explorer.before != explorer.after, explorer
    assert not explorer.report_changed, f"a report that ignores its slider passed: {explorer}"


# ----------------------------------------------------------------- without a browser


def _cell(prompt="[1]:", source="x = 1", **out):
    output = {"mime": "application/vnd.jupyter.stdout", "text": "", "widget": False,
              "progress_bars": 0, "controls": 0, "images": [], "svgs": [], **out}
    return bl.CellView(0, prompt, source, (output,))


ENV_TEXT = "device                : cpu  (AMD EPYC)\ntorch                 : 2.15.0\n"


def test_find_problems_passes_a_clean_page():
    cells = [_cell(text=ENV_TEXT),
             _cell(mime="image/png", images=[{"natural": [640, 480], "shown": [640.0, 480.0]}]),
             _cell(mime="", widget=True, progress_bars=1, text="sweep: 100% 12/12 [00:01<00:00]"),
             _cell(mime="", widget=True, controls=2, text="batch B 8"),
             _cell(mime="application/vnd.jupyter.stderr", text="UserWarning: noisy timing")]
    assert bl.find_problems(cells, frozenset({"figures", "progress bars", "controls"})) == []


@pytest.mark.parametrize(("cell", "needle"), [
    (_cell(prompt="[ ]:"), "did not run"),
    (_cell(prompt="[*]:"), "did not run"),
    (_cell(mime="application/vnd.jupyter.stderr",
           text="----\nValueError                                Traceback (most recent call last)\n"
                "ValueError: boom"), "error output: ValueError: boom"),
    (_cell(mime="application/vnd.jupyter.stderr",
           text="  Cell In[3], line 1\n    x = (\n        ^\nSyntaxError: incomplete input"),
     "error output: SyntaxError"),
    (_cell(mime="application/vnd.jupyter.stderr", text="sweep:  45%|####5     | 9/20 [00:01<00:02]"),
     "progress bar printed as text"),
    (_cell(text="\x1b[31mred\x1b[0m"), "escape codes"),
    (_cell(mime="", widget=True, text="Error displaying widget: model not found"),
     "widget that did not render"),
    (_cell(mime="text/plain", text="HBox(children=(HTML(value=''), FloatProgress(value=0.0)))"),
     "widget that did not render"),
    (_cell(mime="image/png", images=[{"natural": [0, 0], "shown": [16.0, 16.0]}]),
     "image that did not render"),
    (_cell(mime="image/png", images=[{"natural": [640, 480], "shown": [0.0, 0.0]}]),
     "image that did not render"),
])
def test_find_problems_names_what_a_learner_would_see(cell, needle):
    problems = bl.find_problems([_cell(text=ENV_TEXT), cell])
    assert any(needle in p for p in problems), problems


def test_find_problems_wants_the_environment_printout_and_what_the_notebook_shows():
    problems = bl.find_problems([_cell(text="hello")], frozenset({"figures", "progress bars"}))
    assert problems == ["no environment printout (utils.print_env()) on the page",
                        "the notebook should show figures, the page has none",
                        "the notebook should show progress bars, the page has none"]
    with pytest.raises(ValueError, match="unknown kinds"):
        bl.find_problems([], frozenset({"figure"}))


def test_missing_chromium_is_one_line_naming_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv(bl.CHROMIUM_ENV_VAR, str(tmp_path / "no-such-chromium"))
    assert bl.find_chromium() is None
    reason = bl.missing_chromium_reason()
    assert "\n" not in reason and "apt-get install -y chromium" in reason


def test_the_list_is_one_notebook_per_line_and_every_module_is_covered():
    lines = [ln for ln in Path(__file__).read_text().splitlines() if ln.startswith('    _nb("')]
    assert len(lines) == len(NOTEBOOKS)
    covered = {p.values[0].split("/")[0] for p in NOTEBOOKS}
    for p in NOTEBOOKS:
        assert (REPO / p.values[0]).is_file(), p.values[0]
    modules_with_notebooks = {nb.parent.name for nb in course_notebooks()}
    assert modules_with_notebooks - covered <= NOT_YET_COVERED, (
        f"add a notebook of {sorted(modules_with_notebooks - covered - NOT_YET_COVERED)} to NOTEBOOKS")


def test_ci_installs_chromium_and_the_readme_says_how_to_run_the_browser_tests():
    ci = (REPO / ".ci" / "run").read_text()
    assert "apt-get install -y chromium" in ci
    assert ci.index("apt-get install -y chromium") < ci.index("\npytest\n"), "before the tests run"
    readme = (REPO / "README.md").read_text()
    assert "pytest -m browser" in readme and "apt-get install -y chromium" in readme
