"""Every ```python block of `README.md` and `docs/*.md` runs.

Blocks run in order, per file, in one fresh `__main__` module (as a notebook's cells or a script would), so
a later block sees what an earlier one defined. A block whose first line is `# doctest: skip` is not run.
Each block is compiled against the Markdown file itself with its real line numbers, so a failing block's
traceback points at the page, and `inspect.getsource` works on the functions a page defines.
New pages are picked up without touching this file.
"""

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = "# doctest: skip"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def doc_pages() -> list[Path]:
    pages = sorted((ROOT / "docs").glob("*.md"))
    readme = ROOT / "README.md"
    return ([readme] if readme.exists() else []) + pages


def python_blocks(text: str) -> list[tuple[int, str]]:
    """`(first line number, source)` of each ```python block, dedented to the fence's indent."""
    blocks = []
    for m in _FENCE.finditer(text):
        indent = len(m.group("indent"))
        lines = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in m.group("body").splitlines()]
        first_line = text.count("\n", 0, m.start("body")) + 1
        blocks.append((first_line, "\n".join(lines) + "\n"))
    return blocks


def run_page(path: Path) -> int:
    """Run every block of `path` in one fresh `__main__`; returns how many ran."""
    module = types.ModuleType("__main__")
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    ran = 0
    try:
        for first_line, source in python_blocks(path.read_text()):
            if source.lstrip().startswith(SKIP):
                continue
            padded = "\n" * (first_line - 1) + source  # so line numbers are the page's
            exec(compile(padded, str(path), "exec"), module.__dict__)
            ran += 1
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
        # The page's classes and functions hold this dict through their globals, a cycle only `gc`
        # breaks: clear it, so the page's handles and their programs go now, not in a later test's scan.
        module.__dict__.clear()
    return ran


@pytest.mark.parametrize("path", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_blocks_run(path):
    blocks = python_blocks(path.read_text())
    ran = run_page(path)
    assert ran == sum(1 for _, src in blocks if not src.lstrip().startswith(SKIP))


def test_experiments_page_is_collected_and_has_code():
    pages = [p.relative_to(ROOT).as_posix() for p in doc_pages()]
    assert "docs/experiments.md" in pages
    assert len(python_blocks((ROOT / "docs" / "experiments.md").read_text())) >= 5


def test_block_extraction():
    text = (
        "intro\n"
        "```python\n"
        "a = 1\n"
        "```\n"
        "```\n"
        "not python\n"
        "```\n"
        "- a list item:\n"
        "  ```python\n"
        "  b = a + 1\n"
        "  if b:\n"
        "      c = b\n"
        "  ```\n"
        "```python\n"
        "# doctest: skip\n"
        "raise SystemExit\n"
        "```\n"
    )
    assert python_blocks(text) == [
        (3, "a = 1\n"),
        (10, "b = a + 1\nif b:\n    c = b\n"),
        (15, "# doctest: skip\nraise SystemExit\n"),
    ]


def test_failing_block_points_at_the_page_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x\nassert y == 2\n```\n")
    with pytest.raises(AssertionError) as info:
        run_page(page)
    frame = info.traceback[-1]
    assert (Path(str(frame.path)), frame.lineno + 1) == (page, 11)


def test_skipped_block_does_not_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\n# doctest: skip\nraise RuntimeError\n```\n```python\nz = 3\n```\n")
    assert run_page(page) == 1


# ---------------------------------------------------------------- docs/jupyter.md quotes the real messages
def _text_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```text\n(.*?)^```$", text, re.M | re.S)]


def _flat(text: str) -> str:
    """`text` with its line wrapping and Markdown code ticks of either width undone."""
    return " ".join(text.replace("``", "").split())


def test_the_jupyter_page_quotes_the_messages_as_the_code_writes_them():
    """docs/jupyter.md has no ```python block for `test_page_code_blocks_run`: what it quotes (the lines a
    user reads, inline and in ```text blocks) is checked here against the strings nitro_ipy writes."""
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    from nitro_ipy._notebook import _magics, _widgets
    from nitro_ipy._base._report import Explanation

    page = (ROOT / "docs" / "jupyter.md").read_text()
    flat, blocks = _flat(page), _text_blocks(page)
    n = "n"
    quoted = [
        _widgets.RETIRED_NO_NAME,
        _widgets.RETIRED_MOVED_ON.format(name=n),
        _widgets.SAVED_REBUILD.format(name=n),
        _widgets.SAVED_STOP.format(what=" of `Regressor` (3 epochs)"),
        "stop asked: the run ends at the next step boundary, nothing lost",
        "nothing rebuilt: no name in the namespace holds this handle any more;",
        Explanation(["GraphConst `hidden`: 16 -> 8"], [f"argument `a{i}` shape: [16] -> [8]" for i in range(4)]).summary(),
        Explanation(["GraphConst `hidden`: 32 -> 8192"], [f"argument `a{i}` shape: [32] -> [8192]" for i in range(6)]).summary(),
        "nitro_ipy: compile cache emptied; counters zeroed.",
        "nitro_ipy: the post-cell hook failed (",
        "); your cell ran normally.",
    ]
    for line in quoted:
        assert _flat(line) in flat, line
    assert _magics.NO_WIDGETS + "\n" in blocks
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nitro_ipy")
    try:
        with pytest.raises(UsageError) as err:
            shell.run_line_magic("nitro_stats", "--bogus")
    finally:
        shell.run_line_magic("unload_ext", "nitro_ipy")
    assert f"UsageError: {err.value}\n" in blocks
