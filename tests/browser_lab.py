"""Drive the course's notebooks in JupyterLab and headless Chromium, as a learner does.

The helper of ``tests/test_browser.py``. It starts a JupyterLab server from the
repository (a free localhost port, a random token, its own settings, workspaces and
runtime folders, ``COURSE_SMOKE=1``), opens a notebook in a Playwright page, runs it
with the Run menu's "Run All Cells", waits until the kernel is idle and every queued
cell has finished, reads what the page shows, moves every ipywidgets control and
takes screenshots. :func:`find_problems` turns what the page shows into a list of
problems a learner would see (an empty list is a pass).

The browser is Debian's ``chromium`` package, passed to Playwright as
``executable_path``: nothing is downloaded at test time (``playwright install`` is
never needed). ``COURSE_CHROMIUM`` names another Chromium binary.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import nbformat
import psutil

CHROMIUM_PACKAGE = "chromium"
CHROMIUM_ENV_VAR = "COURSE_CHROMIUM"
# Chromium reaches for Google's services at start; the machines the course is tested
# on have no network but localhost, so those connections are switched off.
CHROMIUM_ARGS = ("--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage")
VIEWPORT = {"width": 1400, "height": 900}
# One screenshot covers at most this many CSS pixels of the notebook; a taller notebook
# is captured in several parts (Chromium's largest capture is 16384 px).
SCREENSHOT_PART_PX = 8000

# JupyterLab settings for the test: no autosave (a run must never write outputs into the
# repository's notebooks); every cell attached to the page (no windowing, so every output
# can be read and captured); the notebook's kernel started without asking (on a loaded
# machine JupyterLab can otherwise ask "Select Kernel" before it has read the notebook's
# metadata: the box "Always start the preferred kernel" of that dialog); no news or
# update checks (no network).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none", "autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}

# What a learner must never see.
TQDM_TEXT_BAR = re.compile(r"\d+%\|[^|\n]*\|\s*\d+/\d+")  # "45%|####      | 9/20"
ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)(: |$)", re.M)
WIDGET_AS_TEXT = re.compile(r"^(HBox|VBox|Box|IntProgress|FloatProgress|[A-Z]\w*Slider|Dropdown)\(",
                            re.M)
WIDGET_NOT_SHOWN = ("Error displaying widget", "Loading widget...")
ENV_PRINTOUT = (re.compile(r"^device +: ", re.M), re.compile(r"^torch +: \d", re.M))


class LabError(RuntimeError):
    """JupyterLab or the page did not do what the test needs (with what it showed)."""


def find_chromium() -> str | None:
    """The Chromium binary to drive: ``$COURSE_CHROMIUM``, else ``chromium`` on the PATH."""
    override = os.environ.get(CHROMIUM_ENV_VAR)
    if override:
        return override if Path(override).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_chromium_reason() -> str:
    """The one-line skip reason where no Chromium is found."""
    return (f"no Chromium browser: install Debian's `{CHROMIUM_PACKAGE}` package "
            f"(apt-get install -y {CHROMIUM_PACKAGE}) or set {CHROMIUM_ENV_VAR}")


# --------------------------------------------------------------------------- server


@dataclass
class Lab:
    """A running JupyterLab server started by :func:`start_lab`."""

    process: subprocess.Popen
    url: str          # http://127.0.0.1:PORT/
    token: str
    root: Path
    state_dir: Path   # settings, workspaces, runtime files, ledgers, the server log
    log_path: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)  # every process it started

    def folder_url(self, folder: str, workspace: str) -> str:
        """A fresh workspace (``?reset``: the launcher only) browsing ``folder``."""
        return f"{self.url}lab/workspaces/{workspace}/tree/{folder}?reset&token={self.token}"

    def api(self, method: str, path: str, timeout_s: float = 10.0) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        if method in ("POST", "PUT", "PATCH"):
            req.data = b"{}"
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - localhost only
            body = r.read()
        return json.loads(body) if body else None

    def remember_children(self) -> None:
        """Note the server's descendants (kernels and what they started) for :func:`stop_lab`."""
        try:
            for p in psutil.Process(self.process.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_lab(root: Path, state_dir: Path, env: dict[str, str] | None = None,
              timeout_s: float = 120.0) -> Lab:
    """Start ``jupyter lab`` serving ``root`` on a free 127.0.0.1 port, headless.

    Args:
        root: the folder the server serves, and the kernels' starting point.
        state_dir: an empty folder for this server's own settings, workspaces,
            Jupyter config, data and runtime files, IPython profile and ledgers, so
            that two servers (two pytest workers) share nothing and the
            learner's own Jupyter setup is neither read nor changed.
        env: extra environment variables for the server and so for its kernels.
        timeout_s: how long to wait for the server to answer.

    Raises:
        LabError: the server exited or did not answer in time (with its log).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    dirs = {name: state_dir / name for name in
            ("settings", "workspaces", "config", "data", "runtime", "ipython", "results")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    for relpath, values in LAB_SETTINGS.items():
        f = dirs["settings"] / relpath
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    token = secrets.token_hex(16)
    full_env = {**os.environ,
                "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
                "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
                "JUPYTER_CONFIG_DIR": str(dirs["config"]),
                "JUPYTER_DATA_DIR": str(dirs["data"]),
                "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
                "IPYTHONDIR": str(dirs["ipython"]),
                "COURSE_RESULTS_DIR": str(dirs["results"]),
                **(env or {})}
    for name in ("JUPYTER_TOKEN", "JUPYTER_PORT", "JUPYTER_PREFER_ENV_PATH"):
        full_env.pop(name, None)
    log_path = state_dir / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.allow_root=True",            # CI runs as root
           "--ServerApp.terminals_enabled=False",
           "--LabApp.extension_manager=readonly"]    # no extension listing from the network
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=root, env=full_env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(process, "", token, root, state_dir, log_path)
    deadline = time.monotonic() + timeout_s
    info_file = dirs["runtime"] / f"jpserver-{process.pid}.json"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LabError(f"jupyter lab exited with code {process.returncode}:\n{lab.log_tail()}")
        if info_file.is_file():
            try:
                info = json.loads(info_file.read_text())
                lab.url = f"http://127.0.0.1:{info['port']}/"
                lab.api("GET", "api/status")
                return lab
            except (ValueError, KeyError, OSError):
                pass  # written but not complete yet, or not listening yet
        time.sleep(0.25)
    stop_lab(lab)
    raise LabError(f"jupyter lab did not answer within {timeout_s:.0f} s:\n{lab.log_tail()}")


def shutdown_kernels(lab: Lab, relpath: str | None = None) -> None:
    """Shut down the sessions (and kernels) of one notebook, or of all."""
    lab.remember_children()
    for s in lab.api("GET", "api/sessions"):
        if relpath is None or s.get("path") == relpath:
            lab.api("DELETE", f"api/sessions/{s['id']}", timeout_s=30)


def stop_lab(lab: Lab, timeout_s: float = 30.0) -> list[str]:
    """Stop the server and every process it started; return what still runs (ideally nothing).

    The server is asked to shut down (which stops its kernels), then terminated, then
    killed; kernels run in sessions of their own, so every descendant seen is killed
    by its pid too.
    """
    lab.remember_children()
    server = lab.process
    if server.poll() is None and lab.url:
        try:
            lab.api("POST", "api/shutdown")
        except OSError:
            pass
    for sig, wait_s in ((None, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if sig is not None and server.poll() is None:
            server.send_signal(sig)
        try:
            server.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    left = [p for p in lab.seen.values() if _alive(p)]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    still = [f"pid {p.pid}: {' '.join(p.cmdline()[:4])}" for p in lab.seen.values() if _alive(p)]
    if server.poll() is None:
        still.insert(0, f"pid {server.pid}: jupyter lab")
    return still


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --------------------------------------------------------------------------- the page

# What the page shows, read in one pass: per code cell its prompt and its outputs.
READ_PAGE_JS = r"""
() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel) return null;
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.width, r.height]; };
  return Array.from(panel.querySelectorAll('.jp-Notebook .jp-CodeCell')).map((cell) => {
    const prompt = (cell.querySelector('.jp-InputPrompt') || {textContent: ''}).textContent.trim();
    const outputs = Array.from(cell.querySelectorAll('.jp-OutputArea-output'))
      .filter((out) => !out.parentElement.closest('.jp-OutputArea-output'))
      .map((out) => ({
        mime: out.getAttribute('data-mime-type') || '',
        text: out.innerText,
        widget: out.classList.contains('jupyter-widgets') || !!out.querySelector('.jupyter-widgets'),
        progress_bars: out.querySelectorAll('.widget-hprogress, .widget-vprogress').length,
        controls: out.querySelectorAll('[data-browser-test-control]').length,
        images: Array.from(out.querySelectorAll('img')).map((im) => ({
          natural: [im.naturalWidth, im.naturalHeight], shown: box(im)})),
        svgs: out.getAttribute('data-mime-type') === 'image/svg+xml'
          ? Array.from(out.querySelectorAll('svg')).slice(0, 1).map((s) => ({shown: box(s)})) : [],
      }));
    return {prompt, outputs};
  });
}
"""

# Tag every ipywidgets control on the page (data-browser-test-control="k") and say what
# kind it is, its label and its value; anything a learner can operate that the test has
# no driver for is listed as kind "unknown", so that it fails loudly, not silently.
FIND_CONTROLS_JS = r"""
() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const kinds = [['.widget-slider', 'slider'], ['.widget-dropdown', 'dropdown'],
                 ['.widget-checkbox', 'checkbox'], ['.widget-toggle-button', 'toggle']];
  const found = [];
  const known = new Set();
  for (const [sel, kind] of kinds) {
    for (const el of panel.querySelectorAll('.jp-OutputArea-output .jupyter-widgets' + sel)) {
      el.setAttribute('data-browser-test-control', String(found.length));
      el.querySelectorAll('input, select, button, textarea, [tabindex]').forEach((c) => known.add(c));
      const label = (el.querySelector('.widget-label') || {textContent: ''}).textContent.trim();
      found.push({index: found.length, kind, label});
    }
  }
  for (const el of panel.querySelectorAll(
      '.jp-OutputArea-output .jupyter-widgets input, .jp-OutputArea-output .jupyter-widgets select, ' +
      '.jp-OutputArea-output .jupyter-widgets button, .jp-OutputArea-output .jupyter-widgets textarea')) {
    if (known.has(el)) continue;
    const w = el.closest('.jupyter-widgets');
    w.setAttribute('data-browser-test-control', String(found.length));
    found.push({index: found.length, kind: 'unknown', label: w.className});
  }
  return found;
}
"""

# The text a control changes when it responds: the report panels (HTML, labels, <pre>)
# in the same widget output outside the control itself; failing those, the control's
# own value.
CONTROL_STATE_JS = r"""
(k) => {
  const el = document.querySelector(`[data-browser-test-control="${k}"]`);
  const out = el.closest('.jp-OutputArea-output');
  const parts = Array.from(out.querySelectorAll(
      '.widget-html-content, .widget-htmlmath-content, .widget-label-basic, pre'))
    .filter((p) => !el.contains(p) && !p.parentElement.closest('pre'))
    .map((p) => p.innerText);
  const handle = el.querySelector('.noUi-handle');
  const select = el.querySelector('select');
  const input = el.querySelector('input');
  const value = handle ? handle.getAttribute('aria-valuenow')
    : select ? select.value : input ? String(input.checked) : el.className;
  return {report: parts.join('\n'), value,
          min: handle ? handle.getAttribute('aria-valuemin') : null,
          options: select ? Array.from(select.options).map((o) => o.value) : []};
}
"""

# Where the run stands: the cells' prompts ("[*]:" queued or running), the kernel as the
# status bar names it ("Python 3 (ipykernel) | Idle"; "No Kernel" before one is
# attached), and the text of any dialog JupyterLab opened.
PROGRESS_JS = r"""
() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const kernel = Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))
    .find((el) => (el.getAttribute('title') || '').startsWith('Change kernel for'));
  const [name, status] = (kernel ? kernel.textContent : '').split('|').map((x) => x.trim());
  const dialog = document.querySelector('.jp-Dialog');
  return {
    prompts: panel ? Array.from(panel.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt'))
      .map((p) => p.textContent.trim()) : [],
    kernel: name || null,
    status: (status || 'unknown').toLowerCase(),
    dialog: dialog ? dialog.innerText : null,
  };
}
"""


@dataclass(frozen=True)
class CellView:
    """One code cell as the page shows it."""

    index: int          # position among the notebook's code cells
    prompt: str         # "[7]:", "[*]:" or "[ ]:"
    source: str         # the cell's source, from the notebook file
    outputs: tuple[dict, ...]

    def name(self) -> str:
        first = next((ln for ln in self.source.splitlines() if ln.strip()), "")
        return f"code cell {self.index + 1} ({self.prompt} `{first[:60]}`)"


@dataclass(frozen=True)
class Control:
    """One ipywidgets control and what moving it did."""

    label: str
    kind: str
    before: str         # its value before
    after: str          # its value after
    report_changed: bool
    detail: str = ""

    def describe(self) -> str:
        return (f"{self.kind} {self.label!r}: {self.before} -> {self.after}, "
                f"{'report changed' if self.report_changed else 'report did NOT change'}"
                + (f" ({self.detail})" if self.detail else ""))


def open_notebook(page, lab: Lab, relpath: str, timeout_s: float = 120.0) -> None:
    """Open a notebook as a learner does; wait until all its cells show and its kernel is idle.

    A fresh workspace shows the notebook's folder; once the launcher lists the
    notebook kernels (JupyterLab knows its kernel specs), a double click on the file
    opens it.
    """
    n_code = sum(c.cell_type == "code" for c in nbformat.read(lab.root / relpath, 4).cells)
    folder, _, name = relpath.rpartition("/")
    workspace = "t" + secrets.token_hex(4)
    page.goto(lab.folder_url(folder, workspace), timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-LauncherCard[data-category='Notebook']", timeout=timeout_s * 1000)
    item = page.locator(".jp-DirListing-item").filter(
        has=page.locator(".jp-DirListing-itemText", has_text=re.compile(rf"^{re.escape(name)}$")))
    item.dblclick(timeout=timeout_s * 1000)
    _wait(page, lambda s: len(s["prompts"]) == n_code, timeout_s,
          f"{relpath}: the page did not show the notebook's {n_code} code cells")
    _wait(page, lambda s: s["status"] == "idle" and s["kernel"] not in (None, "No Kernel"),
          timeout_s, f"{relpath}: the kernel did not start (or the page did not connect to it)")
    if not any(s.get("path") == relpath for s in lab.api("GET", "api/sessions")):
        raise LabError(f"{relpath}: the page shows a kernel, the server has no session for it")


def run_all_cells(page) -> None:
    """The Run menu, then "Run All Cells", as a learner clicks them."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()


def wait_until_done(page, timeout_s: float, describe: Callable[[int], str]) -> float:
    """Wait until no cell is queued or running and the kernel is idle; return the seconds.

    Raises:
        LabError: a dialog opened (a dead kernel, say) or the run outlasted ``timeout_s``;
            the message names the cell that was running.
    """
    start = time.monotonic()
    stable = 0

    def done(s):
        nonlocal stable
        finished = (s["status"] == "idle" and not any("*" in p for p in s["prompts"])
                    and any(re.fullmatch(r"\[\d+\]:", p) for p in s["prompts"]))
        stable = stable + 1 if finished else 0
        return stable >= 3  # idle across three polls: not a gap between two queued cells

    _wait(page, done, timeout_s, "", describe=describe)
    return time.monotonic() - start


def _wait(page, ok: Callable[[dict], bool], timeout_s: float, message: str,
          describe: Callable[[int], str] | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = page.evaluate(PROGRESS_JS)
        if state["dialog"]:
            raise LabError(f"JupyterLab opened a dialog: {' '.join(state['dialog'].split())[:300]}")
        if ok(state):
            return state
        if time.monotonic() > deadline:
            if describe is not None:
                running = next((i for i, p in enumerate(state["prompts"]) if "*" in p), None)
                where = describe(running) if running is not None else "no cell is marked running"
                message = (f"the notebook had not finished after {timeout_s:.0f} s "
                           f"(kernel {state['status']}); still running: {where}")
            raise LabError(message)
        page.wait_for_timeout(500)


def read_page(page, notebook: Path) -> list[CellView]:
    """Every code cell as the page shows it, with its source from ``notebook``."""
    sources = [c.source for c in nbformat.read(notebook, as_version=4).cells
               if c.cell_type == "code"]
    page.evaluate(FIND_CONTROLS_JS)
    raw = page.evaluate(READ_PAGE_JS)
    if raw is None:
        raise LabError("no notebook is open on the page")
    if len(raw) != len(sources):
        raise LabError(f"the page shows {len(raw)} code cells, {notebook.name} has {len(sources)}")
    return [CellView(i, c["prompt"], src, tuple(c["outputs"]))
            for i, (c, src) in enumerate(zip(raw, sources))]


def find_problems(cells: list[CellView], shows: frozenset[str] = frozenset()) -> list[str]:
    """What a learner would see go wrong on the page; an empty list is a pass.

    Args:
        cells: the page, from :func:`read_page`.
        shows: what this notebook must show at least once: ``"figures"``,
            ``"progress bars"`` (tqdm as widgets), ``"controls"`` (ipywidgets).
    """
    unknown = set(shows) - {"figures", "progress bars", "controls"}
    if unknown:
        raise ValueError(f"unknown kinds of output to expect: {sorted(unknown)}")
    problems = []
    not_run = [c for c in cells if not re.fullmatch(r"\[\d+\]:", c.prompt)]
    if not_run:
        problems.append(f"{len(not_run)} of {len(cells)} code cells did not run, "
                        f"the first: {not_run[0].name()}")
    counts = {"figures": 0, "progress bars": 0, "controls": 0}
    env_shown = False
    for cell in cells:
        for out in cell.outputs:
            text = out["text"] or ""
            if all(p.search(text) for p in ENV_PRINTOUT):
                env_shown = True
            if out["mime"] == "application/vnd.jupyter.stderr" and (
                    "Traceback (most recent call last)" in text or ERROR_LINE.search(text)):
                last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:]
                problems.append(f"{cell.name()}: error output: {last[0][:200] if last else ''}")
            if TQDM_TEXT_BAR.search(text) and not out["widget"]:
                problems.append(f"{cell.name()}: a progress bar printed as text, not a widget: "
                                f"{TQDM_TEXT_BAR.search(text).group(0)!r}")
            if "\x1b" in text:
                problems.append(f"{cell.name()}: raw terminal escape codes in the output")
            if any(s in text for s in WIDGET_NOT_SHOWN) or (
                    out["mime"] == "text/plain" and WIDGET_AS_TEXT.search(text)):
                problems.append(f"{cell.name()}: a widget that did not render: {text.strip()[:120]!r}")
            for img in out["images"]:
                if min(img["natural"]) <= 0 or min(img["shown"]) <= 0:
                    problems.append(f"{cell.name()}: an image that did not render "
                                    f"(image {img['natural'][0]}x{img['natural'][1]} px, "
                                    f"shown {img['shown'][0]:.0f}x{img['shown'][1]:.0f})")
                else:
                    counts["figures"] += 1
            for svg in out["svgs"]:
                if min(svg["shown"]) <= 0:
                    problems.append(f"{cell.name()}: an SVG figure shown at zero size")
                else:
                    counts["figures"] += 1
            counts["progress bars"] += out["progress_bars"]
            counts["controls"] += out["controls"]
    if not env_shown:
        problems.append("no environment printout (utils.print_env()) on the page")
    for kind in sorted(shows):
        if counts[kind] == 0:
            problems.append(f"the notebook should show {kind}, the page has none")
    return problems


def exercise_controls(page, timeout_s: float = 20.0) -> list[Control]:
    """Move every ipywidgets control as a learner would and see whether its report changes.

    A slider gets the keyboard (Home, or End where it already sits at its minimum), a
    dropdown the next option, a checkbox or toggle a click. The report is the text the
    kernel writes back next to the control (an explorer's panel); a control with no
    report next to it must at least change its own value.
    """
    results = []
    for ctl in page.evaluate(FIND_CONTROLS_JS):
        k, kind, label = ctl["index"], ctl["kind"], ctl["label"]
        loc = page.locator(f'[data-browser-test-control="{k}"]')
        if kind == "unknown":
            results.append(Control(label, kind, "", "", False,
                                   "no driver for this kind of control: teach exercise_controls"))
            continue
        loc.scroll_into_view_if_needed()
        before = page.evaluate(CONTROL_STATE_JS, k)
        if kind == "slider":
            handle = loc.locator(".noUi-handle").first
            handle.focus()
            handle.press("End" if before["value"] == before["min"] else "Home")
        elif kind == "dropdown":
            options = before["options"]
            nxt = options[(options.index(before["value"]) + 1) % len(options)] if options else None
            if nxt is None or nxt == before["value"]:
                results.append(Control(label, kind, before["value"], before["value"], False,
                                       "a dropdown with a single option cannot be moved"))
                continue
            loc.locator("select").select_option(nxt)
        else:
            loc.locator("input, button").first.click()
        deadline = time.monotonic() + timeout_s
        after = page.evaluate(CONTROL_STATE_JS, k)
        own_report = bool(before["report"])
        while time.monotonic() < deadline:
            changed = (after["report"] != before["report"]) if own_report else (
                after["value"] != before["value"])
            if changed:
                break
            page.wait_for_timeout(250)
            after = page.evaluate(CONTROL_STATE_JS, k)
        changed = (after["report"] != before["report"]) if own_report else (
            after["value"] != before["value"])
        detail = "" if own_report else "no report next to it: its own value was checked"
        if after["value"] == before["value"]:
            detail = "the control itself did not move"
        results.append(Control(label, kind, str(before["value"]), str(after["value"]),
                               changed and after["value"] != before["value"], detail))
    return results


def screenshot_notebook(page, stem: Path) -> list[Path]:
    """Capture the whole notebook: the viewport grows to the notebook's height, in parts
    of at most :data:`SCREENSHOT_PART_PX` pixels; returns the image files.

    JPEG (quality 85), not PNG: encoding a notebook-long PNG took 2.5x as long on the
    loaded 2-core machine, for files of about the same size.
    """
    scroller = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
    total = page.evaluate(f"() => document.querySelector('{scroller}').scrollHeight")
    visible = page.evaluate(f"() => document.querySelector('{scroller}').clientHeight")
    chrome = VIEWPORT["height"] - visible  # menus, toolbar and status bar around it
    part = max(200, min(total, SCREENSHOT_PART_PX))
    page.set_viewport_size({"width": VIEWPORT["width"], "height": part + chrome})
    page.wait_for_timeout(300)
    files = []
    try:
        for i, top in enumerate(range(0, max(total, 1), part)):
            page.evaluate(f"() => {{ document.querySelector('{scroller}').scrollTop = {top}; }}")
            page.wait_for_timeout(200)
            path = stem.with_name(f"{stem.name}{'' if total <= part else f'-part{i + 1}'}.jpg")
            page.screenshot(path=str(path), type="jpeg", quality=85)
            files.append(path)
    finally:
        page.set_viewport_size(VIEWPORT)
    return files
