"""Re-make the docs' screenshots: the browser test's walkthrough of the quickstart (JupyterLab in Debian's
Chromium, an 800 px window), keeping a few of its pictures under docs/images/.

    python3 -m pip install -e ".[browser]" && python3 tools/screenshots.py

Needs `/usr/bin/chromium` (`apt-get install chromium`). Prints what the walkthrough saw.
"""

import pprint
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from _browser import walkthrough  # noqa: E402  (the test's own driver: the docs show what it checks)
from _tensorboard_page import tensorboard_shot  # noqa: E402  (docs/tracking.md's picture, the same way)

# Light and dark of the live notebook (the dark ones switched live, the kernel running), and the reopened
# dark cell (a fresh kernel: what a saved notebook shows).
KEEP = ("stale-cell-light.png", "stale-cell-live-dark.png", "stale-cell-dark.png", "unclicked-light.png",
        "unclicked-live-dark.png", "panel-light.png", "panel-live-dark.png", "stats-light.png",
        "stats-live-dark.png", "progress-light.png", "progress-live-dark.png", "saved-live-dark.png",
        "tensorboard.png")


def main() -> int:
    shots = Path(tempfile.mkdtemp(prefix="nitro-shots-"))
    facts = walkthrough(shots)
    facts["tensorboard"] = tensorboard_shot(shots / "tensorboard.png")
    pprint.pprint(facts)
    out = ROOT / "docs" / "images"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):  # pictures no longer made go too
        if old.name not in KEEP:
            old.unlink()
    for name in KEEP:
        shutil.copy(shots / name, out / name)
        print(f"docs/images/{name}: {(out / name).stat().st_size // 1024} KiB")
    shutil.rmtree(shots, ignore_errors=True)
    bad = facts["errors_reload"] + facts["errors_reopen"] + facts["errors_saved_live"] + len(facts["console_errors"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
