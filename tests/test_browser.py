"""JupyterLab in a real browser: what a learner does, done by headless Chromium.

tests/test_notebooks.py runs the notebooks in a kernel without a browser. This module starts JupyterLab from
the lab's venv (loopback, free port, token), drives Debian's Chromium (/usr/bin/chromium)
through Playwright's CDP connection, and for 00_setup, 06_microbatches and 09_zero_fsdp
clicks Run > Run All Cells, waits for the kernel to go idle, saves, and checks:
  - no error output, except in cells tagged `raises-exception` (cells that fail on
    purpose catch labkit.LaunchError and print it: they have no error output at all);
  - every code cell ran (Run All stops at the first error);
  - 06's schedule explorer and 09's memory calculator are live controls (ipywidgets DOM,
    not an `interactive(children=...)`/`VBox(children=...)` repr, not "Error displaying
    widget"), and choosing another dropdown entry redraws the output;
  - `[rank k]` lines show while their cell is still running (a scratch cell, appended to
    the copy of 00_setup, whose ranks print every second until the test has seen them
    on screen: no verdict depends on timing);
  - the "get notified about official Jupyter news?" pop-up never shows: `make setup`
    installs labkit/assets/jupyterlab-overrides.json as the venv's overrides.json.

Playwright never downloads a browser here: we start Chromium ourselves (so we own its PID)
and connect over CDP. Screenshots go to a temporary folder printed at the end of the module.
Missing Chromium or Playwright: the module is skipped with one line naming the fix.

00_setup runs whole but for its session section and its script cell (`DROPPED_FROM_00`). Of 06 and 09 the copy keeps only the setup cell (the first) and the cells that
make the widget and what it needs (`WIDGET_CELLS`): tests/test_notebooks.py already runs every cell
of both, twice, in a kernel; what only a browser shows is how the widgets render and redraw.
A last test drives a session of persistent ranks (`%ranks start 2`) cell by cell, as a learner would,
and stops a hanging `%%ranks` cell with the toolbar's Interrupt button.
Cost: about 2-3 minutes (JupyterLab and Chromium start, 00 in the quick setting, the session).
"""
from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

import background

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# Flags that work in containers and on machines without internet (see issue 14).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NOTEBOOKS = ("00_setup", "06_microbatches", "09_zero_fsdp")
WIDGET_NOTEBOOKS = ("06_microbatches", "09_zero_fsdp")
# What the browser's copy of 00_setup leaves out: its session section (the last test drives a session in
# JupyterLab cell by cell) and the cell that runs a script in a subprocess (nothing a browser shows; both
# run in tests/test_notebooks.py). About 25 s of CPU.
DROPPED_FROM_00 = ("%ranks start", "%%ranks\nw = ", "%%ranks\ndist.all_reduce(w)", "%%ranks --targets 1",
                   "%ranks stop", 'impl("from_scratch").__file__')  # the schedule explorer, the memory calculator
# What the browser's copies of the widget notebooks keep besides their first cell: the code cells that
# contain one of these (the widget, and the names it uses).
WIDGET_CELLS = {"06_microbatches": ("viz.schedule_explorer(",),
                "09_zero_fsdp": ("memory.param_count(", "memory.calculator(")}
RUN_TIMEOUT = 240  # seconds for one notebook's Run All (quick setting: well under a minute idle)
NEWS_POPUP = "official Jupyter news"


def _missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return (f"no Chromium at {CHROMIUM}: install it with `make browser` "
                "(as root; it runs apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no Playwright in this environment: `make setup` installs it (pip install -e '.[test]')"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(condition, timeout, what, interval=0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(interval)


def _stop(proc: subprocess.Popen, extra=()):
    """SIGTERM the process's group, then SIGKILL whatever is left (its group and ``extra``: psutil.Process
    objects, which signal only the process they were made for, never a later one that reused its pid)."""
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for process in extra:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass
        try:
            proc.wait(timeout=10)
            if sig == signal.SIGTERM and not any(background.living(p) for p in extra):
                return
        except subprocess.TimeoutExpired:
            pass


def _shot(page, path: Path):
    """A screenshot is an artefact, not a verdict. Taken through CDP directly: Playwright's own
    screenshot waits for web fonts, which a busy JupyterLab page can keep it doing for minutes."""
    try:
        cdp = page.context.new_cdp_session(page)
        try:
            # CDP's own default is no timeout: a headless Chromium that never answers held a CI run 10 minutes
            shot = cdp.send("Page.captureScreenshot", {"format": "png"}, timeout=30_000)
            path.write_bytes(base64.b64decode(shot["data"]))
        finally:
            cdp.detach()
    except Exception as err:  # a page closed under us, say
        warnings.warn(f"no screenshot {path.name}: {str(err).splitlines()[0]}")


def _descendants(pid: int) -> list:
    """The process's descendants now, as psutil.Process objects: stopped later by identity, not by pid (a rank
    that ended minutes ago may have left its pid to a process of another test)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


SCRATCH = r'''import time, pathlib, labkit

def ticker(rank, world_size, stop_file):
    # prints every second until the test has seen the lines live (stop_file), at most 2 minutes
    for i in range(120):
        print(f"tick {i}", flush=True)
        if pathlib.Path(stop_file).exists():
            break
        time.sleep(1)
    return rank

assert labkit.launch(ticker, 2, STOP, timeout=300) == [0, 1]
print("scratch done")
'''


@pytest.fixture(scope="module")
def artefacts(request):
    """Screenshots and logs; the folder is kept and named at the end of the module's output."""
    folder = Path(tempfile.mkdtemp(prefix="labkit-browser-"))
    yield folder
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        shots = sorted(p.name for p in folder.glob("*.png"))
        print(f"\n[test_browser] screenshots and logs in {folder}: {', '.join(shots) or 'none'}")


@pytest.fixture(scope="module")
def lab(artefacts):
    """JupyterLab from the venv on a free loopback port with a token, serving a copy of notebooks/."""
    root = artefacts / "work"
    shutil.copytree(REPO / "notebooks", root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    (root / "imgs").symlink_to(REPO / "imgs")  # notebooks show ../imgs/*.png
    stop_file = artefacts / "stop-ticker"
    _drop_cells(root / "notebooks" / f"{NOTEBOOKS[0]}.ipynb", DROPPED_FROM_00)
    _append_scratch_cell(root / "notebooks" / f"{NOTEBOOKS[0]}.ipynb", stop_file)
    for name, markers in WIDGET_CELLS.items():
        _keep_the_widget_cells(root / "notebooks" / f"{name}.ipynb", markers)
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = Path(sys.executable).parent / "jupyter"
    private = artefacts / "jupyter"
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(private / "config"), JUPYTER_RUNTIME_DIR=str(private / "runtime"),
               JUPYTER_DATA_DIR=str(private / "data"), JUPYTERLAB_SETTINGS_DIR=str(private / "user-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(private / "workspaces"), LABKIT_QUICK="1",
               LABKIT_IMPL=os.environ.get("LABKIT_IMPL", "solutions"), PYTHONUNBUFFERED="1")
    log = open(artefacts / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--allow-root"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    kernels: set = set()  # psutil.Process objects
    try:
        def up():
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}; see {artefacts / 'jupyterlab.log'}")
            try:
                return urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5).status == 200
            except OSError:
                return False

        _wait_for(up, 120, "JupyterLab answering on its port")
        yield dict(base=base, token=token, root=root, stop_file=stop_file, pid=server.pid, kernels=kernels)
    finally:
        kernels.update(_descendants(server.pid))  # kernels and their ranks: own sessions, stop them by PID
        _stop(server, kernels)
        log.close()
        assert not any(background.living(p) for p in kernels), "a kernel or rank outlived the server"


def _append_scratch_cell(path: Path, stop_file: Path):
    """The scratch cell goes at the end of (the copy of) the first notebook: no extra kernel to start."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f"STOP = {str(stop_file)!r}\n" + SCRATCH))
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def browser(artefacts):
    """Debian's Chromium, started here (we own its PID), driven by Playwright over CDP."""
    from playwright.sync_api import sync_playwright

    profile = artefacts / "chromium-profile"
    log = open(artefacts / "chromium.log", "w")
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                             "about:blank"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"

        def devtools_port():
            if proc.poll() is not None:
                pytest.fail(f"Chromium exited with {proc.returncode}; see {artefacts / 'chromium.log'}")
            text = port_file.read_text() if port_file.exists() else ""
            return text.split("\n")[0] if "\n" in text else None

        port = _wait_for(devtools_port, 60, "Chromium's DevTools port")
        with sync_playwright() as p:
            cdp = p.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
            context = cdp.new_context(viewport={"width": 1400, "height": 1000})
            try:
                yield context
            finally:
                context.close()
                cdp.close()
    finally:
        _stop(proc)
        log.close()


# ------------------------------------------------------------------------- the learner's actions

def _goto(browser, lab, name):
    page = browser.new_page()
    page.goto(f"{lab['base']}/lab/tree/notebooks/{name}.ipynb?token={lab['token']}")
    return page


def _wait_kernel(page, lab, name):
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=120_000)
    # the page says idle before it has a kernel: ask the server too (a Run All sent while the kernel
    # is still connecting is lost)
    _wait_for(lambda: _kernel_status(page) == "idle" and _server_kernel_state(lab, name) == "idle", 120,
              f"{name}: kernel started and idle after opening")


def _server_kernel_state(lab, name):
    """The server's execution state of the notebook's kernel; None while it has none, or while the server is too
    busy to answer within 10 s (a polling wait then asks again until its own deadline: one slow answer on a loaded
    machine failed a whole CI run, 2026-11-28)."""
    url = f"{lab['base']}/api/sessions?token={lab['token']}"
    try:
        sessions = json.loads(urllib.request.urlopen(url, timeout=10).read())
    except (TimeoutError, urllib.error.URLError):
        return None
    return next((s["kernel"]["execution_state"] for s in sessions
                 if s["path"].endswith(f"notebooks/{name}.ipynb") and s.get("kernel")), None)


def _kernel_status(page):
    return page.evaluate("document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) "
                         ".jp-Notebook-ExecutionIndicator')?.dataset.status")


def _prompts(page):
    return page.evaluate("Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) "
                         ".jp-CodeCell .jp-InputArea-prompt')).map(e => e.textContent.trim())")


def _run_all_from_menu(page):
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


def _wait_done(page, name, timeout=RUN_TIMEOUT, while_running=None):
    """Run All queues every cell ([*]); done = none queued or running, kernel idle, twice in a row."""
    _wait_for(lambda: any("*" in p for p in _prompts(page)) or _all_numbered(page), 30, f"{name}: Run All started")
    seen = {"idle": 0}

    def finished():
        if while_running is not None:
            while_running()
        idle = _kernel_status(page) == "idle" and not any("*" in p for p in _prompts(page))
        seen["idle"] = seen["idle"] + 1 if idle else 0
        return seen["idle"] >= 2

    _wait_for(finished, timeout, f"{name}: every cell run and the kernel idle", interval=1.0)


def _drop_cells(path: Path, markers: tuple):
    """The copy leaves out the code cells holding a marker (each marker must be found)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    dropped = [cell for cell in nb.cells if cell.cell_type == "code" and any(m in cell.source for m in markers)]
    found = {m for m in markers if any(m in cell.source for cell in dropped)}
    assert found == set(markers), f"{path.name}: no cell holds {set(markers) - found}: update DROPPED_FROM_00"
    nb.cells = [cell for cell in nb.cells if not any(cell is d for d in dropped)]
    nbformat.write(nb, path)


def _keep_the_widget_cells(path: Path, markers: tuple):
    """The copy keeps its first code cell (imports, settings) and the code cells holding a marker."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    kept = [code[0]] + [cell for cell in code[1:] if any(m in cell.source for m in markers)]
    found = {m for m in markers if any(m in cell.source for cell in kept)}
    assert found == set(markers), f"{path.name}: no cell holds {set(markers) - found}: update WIDGET_CELLS"
    nb.cells = kept
    nbformat.write(nb, path)


def _all_numbered(page):
    prompts = _prompts(page)
    return bool(prompts) and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts)


def _save(page, lab, name) -> dict:
    """Ctrl+S, wait until the tab is clean, return the saved notebook (outputs as the browser got them)."""
    path = lab["root"] / "notebooks" / f"{name}.ipynb"
    before = path.stat().st_mtime_ns
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    _wait_for(lambda: path.stat().st_mtime_ns != before, 60, f"{name}: saved")
    _wait_for(lambda: page.locator(".lm-TabBar-tab.lm-mod-current.jp-mod-dirty").count() == 0, 30, f"{name}: clean")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def ran(browser, lab, artefacts):
    """name -> (page, saved notebook, live) after Run All; each notebook runs once for all tests.

    All pages open at once so that their kernels start together. `live` holds the scratch
    cell's output as seen while it was running (first notebook only).
    """
    pages = {name: _goto(browser, lab, name) for name in NOTEBOOKS}
    done = {}

    def run(name):
        if name not in done:
            page, live = pages[name], {}
            watch = (lambda: _watch_scratch(page, lab, artefacts, live)) if name == NOTEBOOKS[0] else None
            try:
                _wait_kernel(page, lab, name)
                _run_all_from_menu(page)
                _wait_done(page, name, while_running=watch)
                saved = _save(page, lab, name)
            except BaseException:
                _shot(page, artefacts / f"{name}-FAILED.png")
                raise
            finally:
                lab["stop_file"].write_text("stop\n")  # never leave the ticker running
            _shot(page, artefacts / f"{name}.png")
            lab["kernels"].update(_descendants(lab["pid"]))
            done[name] = (page, saved, live)
        return done[name]

    return run


def _watch_scratch(page, lab, artefacts, live):
    """While the scratch cell (the last) runs: once both ranks' lines show, note it and let it finish."""
    if live:
        return
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").last
    if "*" not in (cell.locator(".jp-InputArea-prompt").text_content() or ""):
        return
    text = cell.locator(".jp-OutputArea").text_content() or ""
    if "[rank 0] tick 1" in text and "[rank 1] tick 1" in text:
        # read the prompt again: still [*] after the lines were on screen = they came while it ran
        if "*" in (cell.locator(".jp-InputArea-prompt").text_content() or ""):
            live["text"] = text
            cell.evaluate("e => e.scrollIntoView()")  # no waiting: its output still grows
            _shot(page, artefacts / "scratch-cell-live.png")
            lab["stop_file"].write_text("seen\n")  # now the ranks may finish


# ------------------------------------------------------------------------- the checks

@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_from_the_run_menu_gives_no_error_output(name, ran):
    page, saved, _ = ran(name)
    unexpected = []
    for index, cell in enumerate(saved["cells"]):
        if cell["cell_type"] != "code" or "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                unexpected.append(f"cell {index}: {out['ename']}: {out['evalue'][:300]}")
        if "".join(cell["source"]).strip() and cell.get("execution_count") is None:
            unexpected.append(f"cell {index}: never ran (Run All stops at the first error)")
    assert not unexpected, f"{name}:\n" + "\n".join(unexpected)
    text = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").inner_text()
    assert "Error displaying widget" not in text


WIDGET_STATE_JS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  return Array.from(panel.querySelectorAll('.jp-OutputArea-output .widget-output'))
              .map(o => o.innerHTML);
}"""


@pytest.mark.parametrize("name", WIDGET_NOTEBOOKS)
def test_widgets_render_as_controls_and_redraw_when_changed(name, ran, artefacts):
    page, _, _ = ran(name)
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    text = panel.inner_text()
    for repr_text in ("Error displaying widget", "interactive(children=", "VBox(children=", "HBox(children="):
        assert repr_text not in text, f"{name}: a widget shows as text ({repr_text!r}): no widget manager"
    # a widget box holding a dropdown and the output it draws into (the explorer, the calculator)
    box = panel.locator(".jp-OutputArea-output .widget-vbox:has(.widget-dropdown select):has(.widget-output)").first
    assert box.count() == 1, f"{name}: no rendered widget with a dropdown and an output"
    dropdown = box.locator(".widget-dropdown select").first
    output = box.locator(".widget-output").first
    box.scroll_into_view_if_needed()
    before = output.inner_html()
    assert "<img" in before or "<pre" in before or "jp-RenderedText" in before, f"{name}: the widget drew nothing"
    # by index: ipywidgets writes option labels with non-breaking spaces
    count, current = dropdown.evaluate("s => [s.options.length, s.selectedIndex]")
    assert count >= 2, f"{name}: a dropdown with {count} option(s)"
    other = (current + 1) % count
    dropdown.select_option(index=other)
    _wait_for(lambda: output.inner_html() not in (before, ""), 60, f"{name}: redraw after choosing option {other}")
    _shot(page, artefacts / f"{name}-after-dropdown.png")


def test_rank_output_shows_while_the_cell_is_still_running(ran):
    page, saved, live = ran(NOTEBOOKS[0])
    assert live, "the scratch cell's [rank 0]/[rank 1] lines never showed while it was running"
    final = "".join("".join(o.get("text", "")) for o in saved["cells"][-1].get("outputs", []))
    assert "scratch done" in final, final[-2000:]


def test_no_jupyter_news_popup(browser, lab, ran, artefacts):
    # The setting comes from the venv's overrides.json (make setup), not from the test's own settings.
    url = f"{lab['base']}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={lab['token']}"
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    # overrides.json changes the schema's defaults; the test's own user settings are empty
    news = reply["settings"].get("fetchNews", reply["schema"]["properties"]["fetchNews"]["default"])
    assert news == "false", (
        f"fetchNews is {news!r}: run `make setup` (it installs "
        "labkit/assets/jupyterlab-overrides.json into .venv/share/jupyter/lab/settings/overrides.json)")
    page, _, _ = ran(NOTEBOOKS[0])  # open for minutes by now: the pop-up would have shown
    toasts = page.evaluate("Array.from(document.querySelectorAll('.jp-Notification-Toast, .Toastify__toast'))"
                           ".map(e => e.innerText)")
    assert not any(NEWS_POPUP in t for t in toasts), toasts
    assert NEWS_POPUP not in page.locator("body").inner_text()


# ------------------------------------------------------------------------- a session in the browser

SESSION_CELLS = [
    "%load_ext labkit\n%ranks start 2 --backend gloo",
    "%%ranks\nx = rank + 1\nprint('hello', rank)",
    "%%ranks\nimport time\ntime.sleep(120)",
    "%%ranks\nprint('after the interrupt', x)",
    "%ranks restart",
    "%%ranks\nprint('fresh', 'x' in dir())",
    "%ranks stop",
]


def _run_cells(page, count):
    """Shift+Enter ``count`` times from the active cell: each queues one cell and moves to the next."""
    for _ in range(count):
        page.keyboard.press("Shift+Enter")


def test_a_session_in_jupyterlab_runs_cells_the_toolbar_interrupts_it_and_it_restarts(browser, lab, artefacts):
    """`%ranks start 2`, a `%%ranks` cell, a hanging one stopped by the toolbar's Interrupt button (reported; the
    ranks keep their variables), `%ranks restart` and a cell on the fresh ranks, as a learner clicks them."""
    import nbformat

    name = "session_in_browser"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in SESSION_CELLS]
    nbformat.write(nb, lab["root"] / "notebooks" / f"{name}.ipynb")
    page = _goto(browser, lab, name)
    began = time.monotonic()
    try:
        _wait_kernel(page, lab, name)
        panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
        page.locator(f"{panel} .jp-CodeCell .jp-InputArea-prompt").first.click()
        _run_cells(page, 3)  # start, a cell, the hanging cell

        def hanging():  # the first two have run, the third is running
            prompts = _prompts(page)
            return re.fullmatch(r"\[\d+\]:", prompts[1]) and "*" in prompts[2]

        _wait_for(hanging, 120, f"{name}: the hanging cell running")
        time.sleep(1.0)  # let the ranks enter time.sleep
        page.locator(f"{panel} .jp-Toolbar [data-command='notebook:interrupt-kernel']").click()
        _wait_for(lambda: re.fullmatch(r"\[\d+\]:", _prompts(page)[2]), 60, f"{name}: the interrupted cell ended")
        _run_cells(page, 4)  # after the interrupt, restart, a fresh cell, stop
        def all_ran():  # Shift+Enter on the last cell added an empty one below it: not ours to run
            prompts = _prompts(page)[:len(SESSION_CELLS)]
            return all(re.fullmatch(r"\[\d+\]:", p) for p in prompts) and _kernel_status(page) == "idle"

        _wait_for(all_ran, 120, f"{name}: every cell run")
        saved = _save(page, lab, name)
    except BaseException:
        _shot(page, artefacts / f"{name}-FAILED.png")
        raise
    finally:
        lab["kernels"].update(_descendants(lab["pid"]))
    seconds = time.monotonic() - began
    _shot(page, artefacts / f"{name}.png")
    texts = ["".join("".join(o.get("text", "")) for o in cell["outputs"]) for cell in saved["cells"]]
    errors = [next((o for o in cell["outputs"] if o["output_type"] == "error"), None) for cell in saved["cells"]]
    assert [i for i, e in enumerate(errors) if e is not None] == [2], [(e["ename"], e["evalue"]) for e in errors if e]
    assert texts[0].startswith("session up of 2 rank(s), backend gloo, local launcher"), texts[0]
    assert texts[1] == "[rank 0] hello 0\n[rank 1] hello 1\n", texts[1]
    assert errors[2]["ename"] == "SessionInterrupted"
    assert "rank 0 was at your cell, line 2: time.sleep(120)" in errors[2]["evalue"], errors[2]["evalue"]
    assert texts[3] == "[rank 0] after the interrupt 1\n[rank 1] after the interrupt 2\n", texts[3]
    assert texts[4].startswith("session up of 2 rank(s)") and texts[5] == "[ranks 0-1] fresh False\n", texts[4:6]
    assert texts[6] == "session stopped\n", texts[6]
    print(f"[test_browser] the session story took {seconds:.1f} s in the browser")
