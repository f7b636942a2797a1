"""Open every course notebook in JupyterLab, in headless Chromium, and check what a learner sees.

nbval proves that the cells compute their saved outputs; it cannot tell whether JupyterLab shows
them. This script starts JupyterLab from the project's environment on 127.0.0.1, opens each
notebook in Chromium (driven by Playwright, with the system's Chromium: no browser download) and
checks the page itself:

- the widget cells (those that call ipywidgets) run in a live kernel, selected and run with
  Ctrl+Enter, together with the cells they read names from (found by the names each cell defines
  and reads), so that a widget's callback has what it needs. nbval already executes every cell, so
  the other cells are not run again: their saved outputs are rendered. Where the cells a widget needs
  took longer than --live-budget seconds when the notebook was last executed (as recorded in the
  notebook), nothing runs and the widgets are checked as saved (the copies are trusted, so that
  JupyterLab renders the saved widget state, as it does for the author). Whatever the budget, each
  kind of live check (a slider moved, a glass engine stepped) runs in at least one notebook: the one
  whose cells for it took least;
- every widget view renders: controls present (sliders where the cell builds sliders), no
  "Error displaying widget" or "Loading widget..." anywhere in the notebook; in a live kernel,
  moving a slider one step makes the kernel redraw the widget's output, and pressing a glass engine's
  "step" button (minfer.lab.glass) moves its view on;
- every plot shows: each cell with a saved image, and each widget cell that plots, displays a
  decoded <img>; no cell that ran shows a traceback.

One screenshot of each whole notebook, and one of each widget cell, go to --screenshots. The
notebooks are copied to a temporary folder first, and JupyterLab gets temporary settings,
workspaces and runtime folders: nothing on disk or in the user's Jupyter set-up is touched.

    python tests/browser/notebooks_in_browser.py --screenshots build/screenshots [notebooks/00_measure.ipynb ...]

(`make test-browser SCREENSHOTS=dir` runs it.) Exit status 1 when any check failed; each failure
names the notebook, the cell and what was missing.
"""
from __future__ import annotations

import argparse
import ast
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

import nbformat
from nbformat.sign import NotebookNotary
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # minfer from this checkout, as the notebooks use it
from minfer.lab.bench.notebook_cells import calls, code_cells, needed_cells, python_source, recorded_seconds  # noqa: E402

CHROMIUM_ARGS = [  # the closed network refuses Chromium's background connections: don't make them
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
WIDGET_CALLS = {"interact", "interactive", "interact_manual"}
# default --live-budget: the notebooks whose widgets need only a few seconds of cells (10 and 12, about 5 s
# recorded) run live, and so does the quickest glass engine (bring_each_kind_to_life). Beside the other tests a
# notebook brought to life takes 3-4 times its recorded seconds, and nbval runs every cell anyway: the other
# widgets are checked as saved, which is what a learner sees before running anything.
LIVE_BUDGET_S = 6
CELL_TIMEOUT_S = 300
WIDGET_TIMEOUT_S = 60
TQDM_COUNT = re.compile(r"(\d+)/(\d+) \[[\d:]+<")  # tqdm's "3/20 [00:01<00:05"
VIEWPORT = {"width": 1280, "height": 900}
MAX_SCREENSHOT_HEIGHT = 30000  # px; a longer notebook is cut at the bottom


# -------------------------------------------------------------------------------------------------
# What to run and what to expect, read from the .ipynb file


@dataclass
class NotebookPlan:
    path: Path
    cells: list[dict]
    widget_cells: list[int] = field(default_factory=list)  # cells that call ipywidgets
    image_cells: list[int] = field(default_factory=list)  # cells that must show an <img>
    slider_cells: list[int] = field(default_factory=list)  # widget cells that build a slider
    needed_cells: list[int] = field(default_factory=list)  # the widget cells and the cells they need, in order
    needed_seconds: float | None = None  # how long those took when the notebook was last executed
    run_cells: list[int] = field(default_factory=list)  # needed_cells within the budget, else none
    glass_cells: list[int] = field(default_factory=list)  # cells that show a GlassEngine (minfer.lab.glass)
    live_cells: list[int] = field(default_factory=list)  # the widget cells that run_cells bring to life

    def describe(self) -> str:
        if not self.widget_cells:
            return "no widgets, saved outputs"
        took = "no recorded times" if self.needed_seconds is None else f"recorded {self.needed_seconds:.0f} s"
        if self.run_cells:
            saved = [i for i in self.widget_cells if i not in self.live_cells]
            return (f"ran cells {self.run_cells} ({took}) for the widgets in {self.live_cells}"
                    + (f"; those in {saved} as saved" if saved else ""))
        return f"widgets in {self.widget_cells} as saved: cells {self.needed_cells} would take too long ({took})"


def ipywidgets_names(tree: ast.AST) -> set[str]:
    """The names an import statement binds to ipywidgets or anything imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "ipywidgets"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ipywidgets":
            names |= {a.asname or a.name for a in node.names}
    return names


def plan_notebook(path: Path, live_budget_s: float) -> NotebookPlan:
    cells = json.loads(path.read_text())["cells"]
    plan = NotebookPlan(path, cells)
    code = code_cells(cells)
    sources = {i: python_source(cells[i]) for i in code}
    trees = {i: ast.parse(sources[i]) for i in code}
    widget_names = set().union(*(ipywidgets_names(t) for t in trees.values()))
    plan.glass_cells = [i for i in code if calls(trees[i], {"GlassEngine"})]
    plan.widget_cells = sorted({i for i in code if calls(trees[i], WIDGET_CALLS | widget_names)} | set(plan.glass_cells))
    plan.slider_cells = [i for i in plan.widget_cells if "Slider" in sources[i]]
    plan.image_cells = [i for i in code
                        if any("image/png" in out.get("data", {}) for out in cells[i].get("outputs", []))]
    plan.image_cells += [i for i in plan.widget_cells if re.search(r"\bplt\.", sources[i]) and i not in plan.image_cells]
    plan.image_cells.sort()
    if not plan.widget_cells:
        return plan
    plan.needed_cells, plan.needed_seconds = needed_with_seconds(cells, plan.widget_cells)
    if plan.needed_seconds is not None and plan.needed_seconds <= live_budget_s:
        plan.run_cells, plan.live_cells = plan.needed_cells, plan.widget_cells
    elif plan.glass_cells:  # the glass engine alone may still be quick to bring to life: its button is the check
        needed, seconds = needed_with_seconds(cells, plan.glass_cells)
        if seconds is not None and seconds <= live_budget_s:
            plan.run_cells, plan.live_cells, plan.needed_seconds = needed, plan.glass_cells, seconds
    return plan


def needed_with_seconds(cells: list[dict], targets: list[int]) -> tuple[list[int], float | None]:
    """The cells to run for targets (the first code cell and every cell that last defined a name a needed cell
    reads, transitively) and how long they took when last executed (None when a cell has no recorded time)."""
    needed = needed_cells(cells, targets)
    seconds = [recorded_seconds(cells[i]) for i in needed]
    return needed, None if None in seconds else sum(seconds)


def bring_each_kind_to_life(plans: list[NotebookPlan]) -> None:
    """Make sure each kind of live check (sliders, glass engines) runs somewhere: where no plan within the budget
    has one, the cell of that kind whose needed cells recorded the least time joins its notebook's run."""
    for kind in ("slider_cells", "glass_cells"):
        if any(set(getattr(plan, kind)) & set(plan.live_cells) for plan in plans):
            continue
        options = [(seconds, plan.path.name, cell, needed, plan) for plan in plans for cell in getattr(plan, kind)
                   for needed, seconds in [needed_with_seconds(plan.cells, [cell])] if seconds is not None]
        if options:
            _, _, cell, needed, plan = min(options, key=lambda option: option[:3])
            plan.live_cells = sorted(set(plan.live_cells) | {cell})
            plan.run_cells, plan.needed_seconds = needed_with_seconds(plan.cells, plan.live_cells)


# -------------------------------------------------------------------------------------------------
# JupyterLab in a private, temporary set-up


SETTINGS = {  # plugin -> user settings (JupyterLab reads <settings dir>/<package>/<plugin>.jupyterlab-settings)
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "scrollPastEnd": False},  # every cell in the page
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin": {"enabled": False},
}


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line contains text (a temporary folder of this run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # it exited meanwhile
                pass
    return pids


def kill_leftovers(workdir: Path) -> list[str]:
    """Kill what outlived its parent: kernels (their connection file is in workdir/runtime) and Chromium's
    crash handler (its database is in workdir/chromium-config); return their command names."""
    leftovers = []
    for pid in processes_mentioning(str(workdir)):
        try:
            leftovers.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3])
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return [b" ".join(c).decode(errors="replace")[:120] for c in leftovers]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` from this Python's environment, serving a copy of the notebooks; shut down with its kernels."""

    def __init__(self, notebooks: list[Path], workdir: Path):
        self.workdir = workdir
        self.root = workdir / "notebooks"
        self.root.mkdir()
        (workdir / "data").mkdir()
        notary = NotebookNotary(data_dir=str(workdir / "data"))  # the signatures JupyterLab will check
        for nb in notebooks:
            shutil.copy2(nb, self.root / nb.name)
            with warnings.catch_warnings():  # (a cell without an id: JupyterLab's reader adds it the same way)
                warnings.simplefilter("ignore")
                notary.sign(nbformat.read(self.root / nb.name, as_version=4))
        for plugin, values in SETTINGS.items():
            package, name = plugin.rsplit("/", 1)
            target = workdir / "settings" / package / f"{name}.jupyterlab-settings"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "jupyterlab.log"
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ, MINFER_IMPL=os.environ.get("MINFER_IMPL", "solutions"),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                         ("IPYTHONDIR", "ipython")]:
            env[var] = str(self.workdir / sub)
        env.pop("JUPYTER_PATH", None)
        return env

    def start(self) -> None:
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--ServerApp.port_retries=0", "--LabApp.news_url=",  # no fetching of news or updates
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(cmd, cwd=self.root, env=self.env(), stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with status {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer on {self.url} within 120 s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def api(self, method: str, path: str):
        request = urllib.request.Request(self.url + path, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def page_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?reset&token={self.token}"

    def shut_down_kernels(self) -> None:
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")

    def stop(self) -> None:
        """Shut the server down, its kernels first."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.shut_down_kernels()
                self.api("POST", "/api/shutdown")
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait()
        self.log.close()


# -------------------------------------------------------------------------------------------------
# The checks in the page


class Notebook:
    """One notebook open in JupyterLab: its cells, found by their index in the .ipynb file."""

    def __init__(self, page, plan: NotebookPlan):
        self.page, self.plan = page, plan
        self.name = plan.path.name
        self.failures: list[str] = []

    def fail(self, cell: int | None, what: str) -> None:
        where = f"{self.name} cell {cell}" if cell is not None else self.name
        self.failures.append(f"{where}: {what}")

    def cell(self, index: int):
        return self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(index)

    def open(self, url: str) -> None:
        self.page.goto(url)
        self.page.wait_for_function(
            "n => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell').length === n",
            arg=len(self.plan.cells), timeout=60_000)
        # The kernel is ready once the status bar reads "Python 3 (ipykernel) | Idle".
        self.page.locator(".jp-StatusBar-Widget").get_by_text(re.compile(r"\|\s*Idle$")).wait_for(timeout=180_000)
        self.no_dialog("after opening")

    def no_dialog(self, when: str) -> None:
        """A modal dialog (kernel error, kernel choice) blocks the page: report its text."""
        dialog = self.page.locator(".jp-Dialog")
        if dialog.count():
            raise RuntimeError(f"a dialog is open {when}: {dialog.first.inner_text()[:500]!r}")

    def run(self, index: int, execution_count: int) -> None:
        """Select the cell by its prompt and run it with Ctrl+Enter, as a learner would; wait until it is done.

        Done means the prompt went to [*] and then to this kernel's execution count (the saved prompt may
        already show that number)."""
        cell = self.cell(index)
        prompt = cell.locator(".jp-InputPrompt").first
        prompt.evaluate("""el => { el.sawBusy = false;
            new MutationObserver(() => { if (el.textContent.includes('*')) el.sawBusy = true; })
                .observe(el, {subtree: true, childList: true, characterData: true}); }""")
        prompt.click()
        self.page.keyboard.press("Escape")  # command mode: Ctrl+Enter runs the cell and keeps it selected
        self.page.keyboard.press("Control+Enter")
        try:
            self.page.wait_for_function("([el, done]) => el.sawBusy && el.textContent.trim() === done",
                                        arg=[prompt.element_handle(), f"[{execution_count}]:"],
                                        polling=200, timeout=CELL_TIMEOUT_S * 1000)
        except PlaywrightTimeout:
            self.no_dialog(f"while cell {index} runs")
            self.fail(index, f"did not finish within {CELL_TIMEOUT_S} s (prompt {prompt.inner_text().strip()!r})")
            return
        outputs = cell.locator(".jp-OutputArea-output")
        for i in range(outputs.count()):
            text = outputs.nth(i).inner_text()
            if "Traceback (most recent call last)" in text:
                self.fail(index, f"raised when run in the browser:\n{text[-1500:]}")
                break

    def check_widgets(self, index: int, live: bool) -> None:
        cell = self.cell(index)
        views = cell.locator(".jp-OutputArea-output .jupyter-widgets")
        try:
            views.first.wait_for(timeout=WIDGET_TIMEOUT_S * 1000)
        except PlaywrightTimeout:
            self.fail(index, f"no widget view rendered; the output shows: {self.output_text(index)[:300] or '(nothing)'!r}")
            return
        deadline = time.monotonic() + WIDGET_TIMEOUT_S
        while "Loading widget..." in self.output_text(index) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = self.output_text(index)
        for message in ("Error displaying widget", "Loading widget..."):
            if message in text:
                self.fail(index, f"the widget output still shows {message!r}: {text[:300]!r}")
        if index in self.plan.slider_cells and cell.locator(".widget-slider").count() == 0:
            self.fail(index, "the cell builds sliders, but no slider is on the page")
        elif cell.locator(".widget-slider, .widget-dropdown, .widget-button, .widget-toggle-buttons, .widget-text").count() == 0:
            self.fail(index, "the widget view has no controls")
        if live and index in self.plan.slider_cells:
            self.move_a_slider(index)
        if live and index in self.plan.glass_cells:
            self.press_step(index)

    def check_other_outputs(self) -> None:
        """Saved widget views elsewhere (progress bars, say) render too, and every progress bar shown is finished."""
        for i, cell in enumerate(self.plan.cells):
            if cell["cell_type"] == "code":
                text = self.output_text(i)
                for message in ("Error displaying widget", "Loading widget..."):
                    if message in text and i not in self.plan.widget_cells:  # (widget cells: reported already)
                        self.fail(i, f"the output shows {message!r}: {text[:300]!r}")
                for done, total in TQDM_COUNT.findall(text):
                    if done != total:
                        self.fail(i, f"a progress bar stopped at {done}/{total}: show it finished, or none")

    def move_a_slider(self, index: int) -> None:
        """One key press on the first slider: the readout changes and the kernel redraws the widget's output."""
        cell = self.cell(index)
        slider, readout = cell.locator(".widget-slider").first, cell.locator(".widget-slider .widget-readout").first
        output = cell.locator(".widget-output").last
        before_value, before_output = readout.inner_text(), output.inner_html()
        slider.locator(".noUi-handle").first.focus()
        self.page.keyboard.press("ArrowRight")
        deadline = time.monotonic() + WIDGET_TIMEOUT_S
        while time.monotonic() < deadline:
            now = output.inner_html()
            redrawn = now != before_output and ("<img" in now if "<img" in before_output else output.inner_text().strip())
            if readout.inner_text() != before_value and redrawn:  # (mid-redraw, the output is empty for a moment)
                return
            time.sleep(0.2)
        self.fail(index, f"moving the slider from {before_value} did not redraw the output "
                         f"(readout now {readout.inner_text()!r}, output {output.inner_text()[:200]!r})")

    def press_step(self, index: int) -> None:
        """Click the glass engine's "step" button: the kernel steps the engine and the step view moves on."""
        cell = self.cell(index)
        view = cell.locator(".widget-html").filter(has_text=re.compile(r"Step \d+")).first
        before = view.inner_text()
        cell.locator(".widget-button").filter(has_text=re.compile(r"^step$")).first.click()
        deadline = time.monotonic() + WIDGET_TIMEOUT_S
        while time.monotonic() < deadline:
            if view.inner_text() != before:
                return
            time.sleep(0.2)
        self.fail(index, f"pressing 'step' did not move the glass engine on (still {before[:120]!r})")

    def check_images(self, index: int) -> None:
        images = self.cell(index).locator(".jp-OutputArea-output img")
        try:
            images.first.wait_for(timeout=WIDGET_TIMEOUT_S * 1000)
        except PlaywrightTimeout:
            self.fail(index, f"no plot shown (no <img> in the output); the output shows: {self.output_text(index)[:300] or '(nothing)'!r}")
            return
        for i in range(images.count()):
            if not images.nth(i).evaluate("img => img.complete && img.naturalWidth > 0"):
                self.fail(index, f"image {i + 1} of the output did not decode")

    def output_text(self, index: int) -> str:
        outputs = self.cell(index).locator(".jp-OutputArea")
        return outputs.first.inner_text() if outputs.count() else ""

    def screenshot(self, folder: Path) -> None:
        """The whole notebook, then each widget cell: the window is made as tall as the notebook first, so
        that every cell is laid out on screen (a cell taller than the window would be cut)."""
        scroller = self.page.locator(".jp-NotebookPanel .jp-WindowedPanel-outer")
        height = scroller.evaluate("el => el.scrollHeight")
        chrome = VIEWPORT["height"] - scroller.bounding_box()["height"]  # menus, toolbar, status bar
        self.page.set_viewport_size({"width": VIEWPORT["width"], "height": int(min(height + chrome, MAX_SCREENSHOT_HEIGHT))})
        scroller.evaluate("el => { el.scrollTop = 0; }")
        self.page.wait_for_timeout(500)
        stem = self.plan.path.stem
        self.page.screenshot(path=folder / f"{stem}.png")
        for index in self.plan.widget_cells:
            self.cell(index).screenshot(path=folder / f"{stem}.cell{index:02d}.png")
        self.page.set_viewport_size(VIEWPORT)


def check_notebook(context, lab: JupyterLab, plan: NotebookPlan, screenshots: Path) -> list[str]:
    page = context.new_page()
    page.set_default_timeout(30_000)
    notebook = Notebook(page, plan)
    try:
        notebook.open(lab.page_url(plan.path.name))
        page.keyboard.press("Control+b")  # close the file browser: the notebook gets the window's width
        for count, index in enumerate(plan.run_cells, start=1):
            notebook.run(index, count)
        for index in plan.widget_cells:
            notebook.check_widgets(index, live=index in plan.live_cells)
        for index in plan.image_cells:
            notebook.check_images(index)
        notebook.check_other_outputs()
        notebook.screenshot(screenshots)
    except Exception as error:  # a page that never loaded, a selector that timed out: say where, keep going
        notebook.fail(None, f"{type(error).__name__}: {error}")
        try:
            page.screenshot(path=screenshots / f"{plan.path.stem}.failed.png")
        except Exception:
            pass
    finally:
        page.close()
        lab.shut_down_kernels()
    return notebook.failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    parser.add_argument("--screenshots", type=Path, default=ROOT / "build" / "screenshots", help="folder for the PNGs")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--live-budget", type=float, default=LIVE_BUDGET_S, metavar="SECONDS",
                        help="run a notebook's widgets live when the cells they need took at most this long "
                             f"when it was last executed (default {LIVE_BUDGET_S:.0f}); else check them as saved")
    args = parser.parse_args()
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if not Path(args.chromium).exists():
        print(f"no Chromium at {args.chromium} (Debian: apt-get install chromium; or --chromium PATH)", file=sys.stderr)
        return 2
    args.screenshots.mkdir(parents=True, exist_ok=True)
    for nb in notebooks:  # this run's pictures only: none left from an earlier run or an older cell numbering
        for old in args.screenshots.glob(f"{nb.stem}.*png"):
            old.unlink()
    plans = [plan_notebook(nb, args.live_budget) for nb in notebooks]
    bring_each_kind_to_life(plans)

    # SIGTERM (a CI timeout) unwinds like Ctrl+C, through the finally blocks that stop Chromium and JupyterLab.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started, failures = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="minfer-browser-") as tmp:
        lab = JupyterLab(notebooks, Path(tmp))
        try:
            lab.start()
            print(f"JupyterLab on {lab.url} ({time.perf_counter() - started:.1f} s); screenshots in {args.screenshots}")
            with sync_playwright() as pw:
                # Playwright gives Chromium a fresh temporary profile; its crash reports go to this run's folder.
                browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_ARGS,
                                             env=dict(os.environ, XDG_CONFIG_HOME=f"{tmp}/chromium-config",
                                                      XDG_CACHE_HOME=f"{tmp}/chromium-cache"))
                try:
                    context = browser.new_context(viewport=VIEWPORT)
                    for plan in plans:
                        t0 = time.perf_counter()
                        found = check_notebook(context, lab, plan, args.screenshots)
                        failures += found
                        print(f"{'FAIL' if found else 'ok  '} {plan.path.name} in {time.perf_counter() - t0:.0f} s: "
                              f"{plan.describe()}; plots in {plan.image_cells or 'none'}", flush=True)
                finally:
                    browser.close()
        finally:
            lab.stop()
            if failures:
                print(f"JupyterLab's log ends:\n{lab.log_tail(20)}", file=sys.stderr)
            time.sleep(1)  # Chromium's crash handler exits a moment after the browser
            leftovers = kill_leftovers(Path(tmp))
            if leftovers:
                failures.append(f"processes left running after JupyterLab and Chromium shut down (killed): {leftovers}")
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    print(f"{len(plans)} notebooks in {time.perf_counter() - started:.0f} s: "
          f"{'all checks passed' if not failures else f'{len(failures)} failures'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
