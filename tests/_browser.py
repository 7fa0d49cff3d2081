"""Drive the quickstart notebook in a real JupyterLab in Debian's Chromium (playwright), as a person would.

Shared by `tests/test_browser.py` (the checks) and `tools/screenshots.py` (the docs' pictures). One
`Lab` serves a temporary copy of the notebook on a loopback port with a token, with its own kernelspec
(this Python, so `PYTHONPATH` reaches the kernel) and its own settings directory (the theme).
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
WIDGET_ERROR = "Error displaying widget"
WIDTH = 800
NARROW = 480  # about a side panel's width (the notebook area of a window split in two)
# A second edit of the helper, then the same handle trained again: its Rebuild button is left unclicked.
UNCLICKED = ("def huber(r, delta=0.7):\n    a = jnp.abs(r)\n"
             "    return jnp.where(a < delta, 0.5 * r**2, delta * (a - 0.5 * delta))\n\nn.train(1);")
UNCLICKED_CELL = "def huber(r, delta=0.7)"  # how `output_of` finds that cell


def chromium_available() -> bool:
    return Path(CHROMIUM).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The server extension's config as the package ships it (installed into `sys.prefix/etc/jupyter/...`).
SERVER_CONFIG = ROOT / "jupyter-config" / "jupyter_server_config.d" / "nitro_ipy.json"


class Server:
    """A Jupyter server (`python -m <module>`) on a loopback port with a token, over a temporary directory,
    with its own config, runtime and data directories. The package's server extension config is also in
    its config directory, so it is on whether or not this checkout is installed (`tests/test_savehook.py`
    checks the installed one); `installed_config=True` leaves that out: only what is installed counts."""

    module = "jupyter_server"
    args: tuple = ()

    def __init__(self, installed_config: bool = False):
        self.dir = Path(tempfile.mkdtemp(prefix="nitro-lab-"))
        self.token = os.urandom(16).hex()
        self.port = _free_port()
        self.settings = self.dir / "_settings"
        self.prepare()
        if not installed_config:
            (self.dir / "_config" / "jupyter_server_config.d").mkdir(parents=True)
            shutil.copy(SERVER_CONFIG, self.dir / "_config" / "jupyter_server_config.d")
        env = dict(os.environ, JUPYTER_PATH=str(self.dir / "_jupyter"), JUPYTER_CONFIG_DIR=str(self.dir / "_config"),
                   JUPYTER_RUNTIME_DIR=str(self.dir / "_runtime"), JUPYTERLAB_SETTINGS_DIR=str(self.settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.dir / "_workspaces"), JUPYTER_PLATFORM_DIRS="1")
        self.log = open(self.dir / "_server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.dir}", "--ServerApp.disable_check_xsrf=False", "--ServerApp.allow_root=True",
             *self.args], cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait()

    def prepare(self):
        """Fill the directory before the server starts."""

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def api(self, path: str, method: str = "GET", body=None):
        req = urllib.request.Request(self.url(f"api/{path}"), method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def server_log(self) -> str:
        self.log.flush()
        return (self.dir / "_server.log").read_text()

    def _wait(self, timeout: float = 60):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited:\n{self.server_log()}")
            with contextlib.suppress(OSError):
                self.api("status")
                return
            time.sleep(0.3)
        raise RuntimeError(f"{self.module} did not answer within {timeout} s")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Lab(Server):
    """A JupyterLab server over a temporary directory holding a copy of the quickstart notebook."""

    module = "jupyterlab"
    args = ("--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.expose_app_in_browser=True")  # window.jupyterapp: the theme is switched live

    def prepare(self):
        shutil.copy(NOTEBOOK, self.dir / "quickstart.ipynb")
        kernels = self.dir / "_jupyter" / "kernels" / "python3"
        kernels.mkdir(parents=True)
        (kernels / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (nitro_ipy)", "language": "python"}))
        self.set_theme("light")

    def set_theme(self, name: str):
        """Write the theme setting (read when the page loads)."""
        path = self.settings / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"theme": THEMES[name]}))
        # Every cell in the DOM (no windowing), so outputs far down the page can be found and measured.
        path = self.settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"windowingMode": "none"}))
        path = self.settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))  # no news toast

    def shutdown_kernels(self):
        for k in self.api("kernels"):
            self.api(f"kernels/{k['id']}", "DELETE")

    def saved(self, name: str = "quickstart.ipynb") -> dict:
        return json.loads((self.dir / name).read_text())


@contextlib.contextmanager
def browser_page(lab: Lab):
    """A Chromium page (800 px wide) that records console errors and page errors in `page.errors`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.errors = []
            page.on("console", lambda m: m.type == "error" and page.errors.append(f"console: {m.text}"))
            page.on("pageerror", lambda e: page.errors.append(f"pageerror: {e}"))
            yield page
        finally:
            browser.close()


def open_notebook(page, lab: Lab, timeout: float = 60_000, name: str = "quickstart.ipynb", reset: bool = False):
    """Open `name` in the page (`reset`: with a fresh workspace, so it is the one notebook open)."""
    page.goto(lab.url(f"lab/tree/{name}?{'reset&' if reset else ''}token={lab.token}"))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout)
    # Every cell shown with its source: on a loaded machine the page adds cells and fills their editors
    # over a while after the first one appears, and a count taken too soon would come up short.
    heads = [("".join(c["source"]).strip().splitlines() or [""])[0][:30] for c in lab.saved(name)["cells"]]
    page.wait_for_function(
        """heads => { const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
          return cells.length === heads.length && cells.every((c, i) => c.classList.contains('jp-MarkdownCell')
            || (c.querySelector('.jp-InputArea-editor')?.textContent || '').trim().startsWith(heads[i])); }""",
        arg=heads, timeout=timeout)
    page.wait_for_function(
        "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator');"
        " return s && s.getAttribute('data-status') === 'idle'; }", timeout=timeout)
    # The kernel connected and idle, not only the indicator: JupyterLab may still be starting it (and ask
    # "Select Kernel" when it is slow to answer), and a cell run before then is never sent.
    for _ in range(int(timeout / 1000)):
        _accept_kernel_dialog(page)
        if page.evaluate("() => { const k = window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel;"
                         " return !!k && k.connectionStatus === 'connected' && k.status === 'idle'; }"):
            break
        page.wait_for_timeout(1000)
    # The file browser takes a third of an 800 px window: collapse the left sidebar, as a user would.
    if page.evaluate("() => (document.querySelector('#jp-left-stack')?.offsetWidth || 0) > 0"):
        page.locator(".jp-Notebook").first.click(position={"x": 2, "y": 2})
        page.keyboard.press("Escape")
        page.keyboard.press("Control+b")


def _accept_kernel_dialog(page):
    """JupyterLab asks "Select Kernel" when the kernel it started for the notebook is slow to answer (a
    loaded machine): a person clicks Select, which keeps the notebook's own kernel."""
    dialog = page.locator(".jp-Dialog:has-text('Select Kernel') .jp-mod-accept")
    if dialog.count():
        dialog.first.click()
        page.wait_for_selector(".jp-Dialog", state="detached", timeout=30_000)


def _idle(page, timeout: float = 120_000):
    page.wait_for_function(
        "() => ![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'))"
        " && document.querySelector('.jp-Notebook-ExecutionIndicator')?.getAttribute('data-status') === 'idle'",
        timeout=timeout)


def _run_active(page):
    """Shift+Enter on the active cell, then wait until it shows a new execution count and the kernel is
    idle: the status indicator alone can still read "idle" for a moment after Shift+Enter on a loaded
    machine, and the next step would then look too soon."""
    _accept_kernel_dialog(page)
    ran = page.locator(".jp-Notebook .jp-Cell.jp-mod-active").element_handle()
    prompt = ran.evaluate("c => c.querySelector('.jp-InputPrompt')?.textContent || ''")
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        "([c, before]) => { if (!c.classList.contains('jp-CodeCell')) return true;"
        " const p = c.querySelector('.jp-InputPrompt')?.textContent || '';"
        " return p !== before && /\\[\\d+\\]/.test(p); }",
        arg=[ran, prompt], timeout=120_000)
    _idle(page)


def run_cells(page, until: str | None = None):
    """Run cells from the active one down (Shift+Enter, waiting for each), stopping after the code cell
    whose source starts with `until` (or at the end)."""
    cells = page.locator(".jp-Notebook .jp-Cell")
    n = cells.count()
    for _ in range(n):
        active = page.locator(".jp-Notebook .jp-Cell.jp-mod-active")
        source, is_last = active.evaluate(
            "c => [c.classList.contains('jp-CodeCell') ? c.querySelector('.jp-InputArea-editor').textContent : '',"
            " !c.nextElementSibling || !c.nextElementSibling.classList.contains('jp-Cell')]")
        _run_active(page)
        if os.environ.get("NITRO_BROWSER_DEBUG"):
            print("ran:", source[:40].replace("\n", " "), "| last:", is_last, flush=True)
        if (until is not None and source.strip().startswith(until)) or is_last:
            return


def select_first_cell(page):
    page.locator(".jp-Notebook .jp-Cell").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")  # command mode


def select_cell_after(page, startswith: str):
    after = cell_index(page, startswith, cells=".jp-Notebook .jp-Cell") + 1
    page.locator(".jp-Notebook .jp-Cell").nth(after).click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")


def switch_theme(page, name: str):
    """Switch the theme of the open page, as Settings > Theme does (the kernel and outputs stay live)."""
    page.evaluate(f"() => window.jupyterapp.commands.execute('apputils:change-theme', {{theme: {json.dumps(THEMES[name])}}})")
    want = "false" if name == "dark" else "true"
    page.wait_for_function(f"() => document.body.dataset.jpThemeLight === '{want}'", timeout=30_000)
    page.wait_for_timeout(500)  # the theme's stylesheet applied


def new_cell(page, code: str):
    """A new code cell below the last one, holding `code` (inserted as text: no auto-indent), run."""
    page.keyboard.press("Escape")
    page.locator(".jp-Notebook .jp-Cell").last.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    _run_active(page)


def computed(page, selector: str, props: tuple) -> list:
    return page.eval_on_selector_all(
        selector, f"els => els.map(e => {{ const s = getComputedStyle(e); return {json.dumps(list(props))}.map(p => s.getPropertyValue(p)); }})")


# The contrast ratio (WCAG 2) of each element's text against what is behind it: its own background and
# its ancestors' composited (translucent tints over the page), computed in the page.
CONTRAST_JS = """els => els.map(e => {
  const parse = c => { const m = c.match(/[\\d.]+/g) || []; return m.map(Number).concat([1]).slice(0, 4); };
  const chain = []; for (let n = e; n; n = n.parentElement) chain.push(getComputedStyle(n).backgroundColor);
  let bg = [255, 255, 255];
  for (const c of chain.reverse()) { const [r, g, b, al] = parse(c);
    bg = [r * al + bg[0] * (1 - al), g * al + bg[1] * (1 - al), b * al + bg[2] * (1 - al)]; }
  const fg = parse(getComputedStyle(e).color);
  const lum = ([r, g, b]) => { const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const [l1, l2] = [lum(fg), lum(bg)].sort((a, b) => b - a);
  return Math.round((l1 + 0.05) / (l2 + 0.05) * 100) / 100;
})"""


def contrasts(page, selector: str) -> list:
    """The text/background contrast ratio of every element matching `selector`."""
    return page.eval_on_selector_all(selector, CONTRAST_JS)


# Every element of a nitro_ipy output wider than its box (cut off, ellipsized or scrolled sideways), or
# reaching past the window's right edge: `class: scroll width > client width` each.
OVERFLOW_JS = """els => els.flatMap(root => [root, ...root.querySelectorAll('*')]).flatMap(e => {
  const box = e.getBoundingClientRect();
  const wide = e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1;
  const out = box.width > 0 && box.right > window.innerWidth + 1;
  return wide || out ? [`${e.tagName.toLowerCase()}.${e.className}: ${e.scrollWidth} > ${e.clientWidth}` +
                        (out ? ` (right edge ${Math.round(box.right)} > ${window.innerWidth})` : '')] : [];
})"""

NITRO_OUTPUTS = ".nitro-panel, .nitro-stats-box, .nitro-message, .nitro-progress, .nitro-action"


def overflowing(page, selector: str = NITRO_OUTPUTS) -> list:
    return page.eval_on_selector_all(selector, OVERFLOW_JS)


# Every element inside a nitro_ipy box whose right edge passes the box's own (a chip overhanging the
# panel): `text: px past` each.
OVERHANG_JS = """els => els.flatMap(box => {
  const edge = box.getBoundingClientRect().right;
  return [...box.querySelectorAll('*')].flatMap(e => { const r = e.getBoundingClientRect();
    return r.width > 0 && r.right > edge + 0.5 ? [`${(e.textContent || e.tagName).slice(0, 40)}: ${Math.round(r.right - edge)}`] : []; });
})"""


def overhanging(page) -> list:
    return page.eval_on_selector_all(".nitro-box", OVERHANG_JS)


# How each nitro_ipy line is drawn: `[class, font family, white-space]` of every `.nitro-line`, and how
# many plain-text outputs say a nitro_ipy line (a line that missed the reporter's look).
LINES_JS = """() => [[...document.querySelectorAll('.nitro-line')].map(e => { const s = getComputedStyle(e);
    return [e.className.split(' ')[1] || '', s.fontFamily, s.whiteSpace]; }),
  [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"]')]
    .filter(e => /nitro_ipy: (compiled|epoch)/.test(e.textContent)).length]"""

# The loss chart's tick labels: `[x ticks, y ticks]`.
TICKS_JS = """svg => ['.nitro-x-axis', '.nitro-y-axis'].map(
  g => [...svg.querySelectorAll(g + ' text.nitro-tick')].map(t => t.textContent))"""


def widget_errors(page) -> int:
    return page.locator(f"text={WIDGET_ERROR}").count()


def shoot(page, selector: str, path: Path, nth: int = 0):
    el = page.locator(selector).nth(nth)
    el.scroll_into_view_if_needed()
    el.screenshot(path=str(path))


# 1 + the index among `cells` of the first whose source starts with `start`, or 0. A notebook just opened
# adds its cells and fills their editors over a few frames, so `cell_index` polls this.
FIND_CELL_JS = """([cells, start]) => 1 + [...document.querySelectorAll(cells)].findIndex(
  c => (c.querySelector('.jp-InputArea-editor')?.textContent || '').trim().startsWith(start))"""


def cell_index(page, startswith: str, cells: str = ".jp-Notebook .jp-CodeCell", timeout: float = 30_000) -> int:
    """The index among `cells` of the first whose source starts with `startswith`, once the page shows it."""
    try:
        found = page.wait_for_function(FIND_CELL_JS, arg=[cells, startswith], timeout=timeout)
    except Exception as e:  # playwright's TimeoutError: say which cell was missing and what was there
        sources = page.eval_on_selector_all(
            cells, "cs => cs.map(c => (c.querySelector('.jp-InputArea-editor')?.textContent || '').slice(0, 40))")
        raise LookupError(f"no cell starts with {startswith!r} after {timeout / 1000:.0f} s; "
                          f"the {len(sources)} cells start: {sources}") from e
    return found.json_value() - 1


def output_of(page, startswith: str):
    """The output area of the code cell whose source starts with `startswith`."""
    return page.locator(".jp-Notebook .jp-CodeCell").nth(cell_index(page, startswith)).locator(".jp-OutputArea")


def save(page):
    """Save the notebook as a person does (Ctrl+S) and wait until JupyterLab has it saved."""
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=30_000)


def _widget_views(nb: dict) -> int:
    return sum("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               for c in nb["cells"] for o in c.get("outputs", ()))


def walkthrough(shots: Path) -> dict:
    """Run the quickstart as a person would and report what was seen (`facts`), writing screenshots
    into `shots`: light theme while running, then a save, a page reload (kernel alive), a reopen on a
    fresh kernel, and the dark theme."""
    shots.mkdir(parents=True, exist_ok=True)
    facts: dict = {}
    lab = Lab()
    try:
        with browser_page(lab) as page:
            open_notebook(page, lab)
            select_first_cell(page)
            run_cells(page, until="n.train(1);")  # the old handle after the edit: both messages
            page.wait_for_selector(".nitro-stale-handle", timeout=60_000)
            facts["message_html"] = page.locator(".nitro-message").first.evaluate("e => e.outerHTML")[:600]
            facts["message_styles"] = computed(page, ".nitro-message", ("border-left-color", "background-color", "line-height"))
            facts["message_titles"] = page.locator(".nitro-message > div:first-child").all_inner_texts()
            shoot(page, ".nitro-stale-handle", shots / "messages-light.png")
            out = output_of(page, "n.train(1);")
            out.scroll_into_view_if_needed()
            out.screenshot(path=str(shots / "stale-cell-light.png"))
            page.locator("button.jupyter-button", has_text="Rebuild handle").click()
            page.wait_for_selector(".nitro-action", timeout=30_000)
            select_cell_after(page, "n.train(1);")  # the click left focus in the output; go on below it
            facts["rebuild_result"] = page.locator(".nitro-action").inner_text()
            facts["rebuild_colour"] = computed(page, ".nitro-action", ("border-left-color",))
            run_cells(page)  # the rest
            # A background run, stopped from the panel's Stop button (the kernel is idle meanwhile).
            page.keyboard.press("Escape")
            page.keyboard.press("b")  # a new cell below the last
            page.keyboard.press("Enter")
            page.keyboard.type("run = n.train(100000, background=True)")
            _run_active(page)
            stop = page.locator("button.jupyter-button", has_text="Stop")
            stop.wait_for(timeout=60_000)
            facts["stop_button"] = stop.count()
            stop.click()
            page.wait_for_selector(".nitro-action:has-text('stop asked')", timeout=30_000)
            page.keyboard.press("Escape")
            page.locator(".jp-Notebook .jp-Cell").last.click(position={"x": 5, "y": 5})
            page.keyboard.press("b")
            page.keyboard.press("Enter")
            page.keyboard.type("print('stopped', run.done, len(run.wait()) < 100000)")
            _run_active(page)
            page.wait_for_selector(".jp-OutputArea-output:has-text('stopped True True')", timeout=60_000)
            facts["stop_result"] = page.locator(".nitro-action:has-text('stop asked')").inner_text()
            facts["panel_text"] = page.locator(".nitro-panel").inner_text()
            facts["panel_chart"] = page.locator(".nitro-panel svg.nitro-chart").count()
            facts["progress_lines"] = page.locator(".nitro-progress").count()
            facts["overflow_live"] = overflowing(page)  # an 800 px window: chips wrap, nothing is cut off
            facts["overhang_live"] = overhanging(page)
            facts["lines_live"], facts["raw_lines"] = page.evaluate(LINES_JS)
            facts["chart_ticks"] = page.locator(".nitro-panel svg.nitro-chart").first.evaluate(TICKS_JS)
            # A narrow side panel's width: every nitro box still holds what is in it (chips wrap inside).
            page.set_viewport_size({"width": NARROW, "height": 900})
            page.wait_for_timeout(500)
            facts["overhang_narrow"] = overhanging(page)
            page.set_viewport_size({"width": WIDTH, "height": 900})
            page.wait_for_timeout(500)
            shoot(page, ".nitro-panel", shots / "panel-light.png")
            shoot(page, ".nitro-stats-box", shots / "stats-light.png")
            output_of(page, "nitro_ipy.cache_reset(); n = Nitro(e").screenshot(path=str(shots / "progress-light.png"))
            # An unclicked Rebuild button: a second edit of the helper, the same handle trained again.
            new_cell(page, UNCLICKED)
            page.wait_for_selector("button.jupyter-button:has-text('Rebuild handle')", timeout=60_000)
            facts["unclicked_live"] = page.locator("button.jupyter-button", has_text="Rebuild handle").count()
            output_of(page, UNCLICKED_CELL).screenshot(path=str(shots / "unclicked-light.png"))
            facts["errors_live"] = widget_errors(page)
            # Saved while that button is live (JupyterLab's autosave does the same): the file keeps its
            # static line instead of the widget view (the server extension), the page keeps the button.
            save(page)
            saved = lab.saved()
            facts["saved_live_views"] = _widget_views(saved)
            facts["saved_live_line"] = ["".join(o["data"]["text/plain"]) for c in saved["cells"] for o in c.get("outputs", ())
                                        if o.get("metadata", {}).get("nitro_ipy", {}).get("live")]
            facts["saved_live_page"] = page.locator("button.jupyter-button", has_text="Rebuild handle").count()
            shutil.copy(lab.dir / "quickstart.ipynb", lab.dir / "saved-live.ipynb")  # reopened below
            # The same live notebook in the dark theme (the kernel alive, the unclicked button a widget).
            switch_theme(page, "dark")
            facts["live_dark_page"] = computed(page, ".jp-Notebook", ("background-color",))
            facts["live_dark_contrast"] = contrasts(page, ".nitro-box")
            facts["overflow_dark"] = overflowing(page) + overhanging(page)
            output_of(page, UNCLICKED_CELL).screenshot(path=str(shots / "unclicked-live-dark.png"))
            out = output_of(page, "n.train(1);")
            out.scroll_into_view_if_needed()
            out.screenshot(path=str(shots / "stale-cell-live-dark.png"))
            shoot(page, ".nitro-panel", shots / "panel-live-dark.png")
            shoot(page, ".nitro-stats-box", shots / "stats-live-dark.png")
            output_of(page, "nitro_ipy.cache_reset(); n = Nitro(e").screenshot(path=str(shots / "progress-live-dark.png"))
            # Moving on: the next cell ends the unclicked button as its HTML line.
            new_cell(page, "print('moved on')")
            page.wait_for_selector(".nitro-action.nitro-retired", timeout=30_000)
            facts["unclicked_ended"] = output_of(page, UNCLICKED_CELL).locator(".nitro-action").inner_text()
            facts["unclicked_after"] = page.locator("button.jupyter-button", has_text="Rebuild handle").count()
            save(page)
            facts["saved_widget_views"] = _widget_views(lab.saved())
            page.reload()
            open_notebook(page, lab)
            facts["errors_reload"] = widget_errors(page)
            lab.shutdown_kernels()
            page.goto("about:blank")
            lab.set_theme("dark")
            open_notebook(page, lab)  # a new session: a fresh kernel, nothing run
            facts["errors_reopen"] = widget_errors(page)
            facts["reopen_messages"] = page.locator(".nitro-message").count()
            facts["reopen_unclicked"] = output_of(page, UNCLICKED_CELL).locator(".nitro-action").inner_text()
            facts["reopen_contrast"] = contrasts(page, ".nitro-box")
            facts["reopen_panel"] = page.locator(".nitro-panel svg.nitro-chart").count()
            facts["dark_styles"] = computed(page, ".nitro-message", ("border-left-color", "background-color", "color"))
            facts["dark_page"] = computed(page, ".jp-Notebook", ("background-color",))
            shoot(page, ".nitro-stale-handle", shots / "messages-dark.png")
            output_of(page, "n.train(1);").screenshot(path=str(shots / "stale-cell-dark.png"))
            shoot(page, ".nitro-panel", shots / "panel-dark.png")
            shoot(page, ".nitro-stats-box", shots / "stats-dark.png")
            page.screenshot(path=str(shots / "reopened-dark.png"))
            # The notebook saved while the Rebuild button was live, reopened on a fresh kernel.
            open_notebook(page, lab, name="saved-live.ipynb", reset=True)
            facts["errors_saved_live"] = widget_errors(page)
            facts["saved_live_reopen"] = output_of(page, UNCLICKED_CELL).locator(".nitro-action").all_inner_texts()
            facts["saved_live_contrast"] = contrasts(page, ".nitro-saved-live")
            output_of(page, UNCLICKED_CELL).screenshot(path=str(shots / "saved-live-dark.png"))
            facts["console_errors"] = list(page.errors)
    finally:
        lab.close()
    return facts


if __name__ == "__main__":
    import pprint

    pprint.pprint(walkthrough(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="nitro-shots-"))))
