"""The executed quickstart exported by nbconvert to HTML, light and dark (`jupyter nbconvert --to html
--theme dark`), each page opened in Debian's Chromium: every nitro output is there as its saved HTML,
visibly styled, and its text reads on its background (the WCAG contrast ratio, computed in the page from
the composited backgrounds, is at least 4.5).

Costs ~60-90 s (one headless run of the quickstart, two exports, one Chromium). Skipped, like the browser
test, only when Chromium is missing outside CI.
"""

import os
import re
import subprocess
import sys

import pytest
from _browser import (
    CHROMIUM, CHROMIUM_ARGS, NOTEBOOK, ROOT, WIDTH, chromium_available, computed, contrasts,
)

pytestmark = [pytest.mark.skipif(
    not chromium_available() and os.environ.get("CI") != "true",
    reason="Chromium is not installed (`apt-get install chromium`); CI installs it and runs this test",
)]

THEMES = ("light", "dark")


def _rgb(text: str) -> tuple:
    return tuple(float(v) for v in re.findall(r"[\d.]+", text)[:4])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("playwright", reason="the `browser` extra: pip install -e '.[browser]'")
    import nbformat
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT))
    from tools import nbrun

    nb, error = nbrun.execute_notebook(str(NOTEBOOK))
    assert error is None, str(error)
    out = tmp_path_factory.mktemp("export")
    nbformat.write(nb, out / "quickstart.ipynb")
    for theme in THEMES:
        subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", f"--theme={theme}",
                        f"--output=quickstart-{theme}", str(out / "quickstart.ipynb")],
                       check=True, capture_output=True, timeout=300)
    facts = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            for theme in THEMES:
                page.goto((out / f"quickstart-{theme}.html").as_uri())
                page.wait_for_selector(".nitro-panel")
                facts[theme] = {
                    "titles": page.locator(".nitro-message > div:first-child").all_inner_texts(),
                    "borders": computed(page, ".nitro-message", ("border-left-color", "background-color")),
                    "actions": page.locator(".nitro-action").all_inner_texts(),
                    "progress": page.locator(".nitro-progress").count(),
                    "panel_chart": page.locator(".nitro-panel svg.nitro-chart polyline").count(),
                    "stats": page.locator(".nitro-stats-box").count(),
                    "boxes": page.locator(".nitro-box").count(),
                    "lines": page.locator(".nitro-progress .nitro-lines").count(),
                    "contrast": contrasts(page, ".nitro-box, .nitro-lines"),
                    "body": computed(page, "body", ("background-color",)),
                }
                page.screenshot(path=str(out / f"export-{theme}.png"), full_page=True)
        finally:
            browser.close()
    return facts


@pytest.mark.parametrize("theme", THEMES)
def test_every_nitro_output_is_in_the_export(exported, theme):
    seen = exported[theme]
    assert seen["titles"] == ["Edit seen: 2 cached programs poisoned",
                              "This handle runs code compiled before your edit"]
    # The Rebuild button, unclicked in a headless run, was ended by the next cell: its line is saved.
    assert seen["actions"] == ["not clicked before the next cell ran; to use the current code: n = n.rebuild()"]
    assert seen["progress"] == 4  # one display per train() call, each its final lines
    assert seen["panel_chart"] == 1 and seen["stats"] == 1


@pytest.mark.parametrize("theme", THEMES)
def test_the_export_is_styled_and_reads(exported, theme):
    seen = exported[theme]
    page = _rgb(seen["body"][0][0])
    assert (sum(page[:3]) < 150) == (theme == "dark")  # the export's own theme
    (info_border, info_bg), (warn_border, warn_bg) = seen["borders"]
    assert info_border != warn_border and _rgb(info_bg)[3] > 0 and _rgb(warn_bg)[3] > 0
    # Both messages, the Rebuild line, the panel, its latest compile, `%nitro_stats`; and the lines of
    # each train() call's display (compiles, epochs).
    assert (seen["boxes"], seen["lines"], len(seen["contrast"])) == (6, 4, 10)
    assert min(seen["contrast"]) >= 4.5, seen["contrast"]
