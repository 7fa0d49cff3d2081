"""A run logged by `nitro_ipy.loggers.TensorBoard`, shown by a real TensorBoard in Debian's Chromium
(playwright), as a person opens it: shared by `tests/test_browser.py` (the check) and
`tools/screenshots.py` (docs/images/tensorboard.png)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _browser import CHROMIUM, CHROMIUM_ARGS

TAGS = ("train/loss", "valid/loss", "step/loss")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_a_run(logdir: Path) -> None:
    """Three epochs of the tests' tiny regression, every step logged, in a subprocess (its own cache)."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from _experiments import Reg, data\n"
        "from nitro_ipy import Nitro\n"
        "from nitro_ipy.loggers import TensorBoard\n"
        "n = Nitro(Reg(), data={'train': data(512), 'valid': data(128, 1)}, batch_size=16, max_epochs=3,\n"
        f"          progress=False, loggers=[TensorBoard({str(logdir)!r}, log_every=4)])\n"
        "n.train()\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, timeout=300)


def tensorboard_shot(path: Path, width: int = 1000) -> dict:
    """Log a run, serve it with `tensorboard`, open its scalars in Chromium and screenshot them to `path`.
    Returns what the page showed: `tags` (of `TAGS`, those whose card is drawn)."""
    logdir = Path(tempfile.mkdtemp(prefix="nitro-tb-")) / "tiny"
    log_a_run(logdir)
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir.parent),
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "data/runs", timeout=1).read()
                break
            except OSError:
                time.sleep(0.5)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.goto(url + "?pinnedCards=[]#scalars&tagFilter=loss", wait_until="networkidle")
            page.wait_for_selector("text=train/loss", timeout=60_000)
            page.wait_for_timeout(1500)  # the charts draw after their data arrives
            tags = [t for t in TAGS if page.locator(f"text={t}").count()]
            page.screenshot(path=str(path))
            browser.close()
        return {"tags": tags}
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(logdir.parent, ignore_errors=True)
