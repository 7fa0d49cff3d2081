"""Run `notebooks/quickstart.ipynb` headless through a real Jupyter kernel and print what a user would see.

    python3 -m pip install -e ".[test]" && python3 demo.py

Cell by cell: the source, then its text outputs (printed lines, the `text/plain` of displays and results).
Widgets print as their `text/plain` fallback; widgets closed by the time the cell ended (the progress bars)
are left out, as a notebook would show them. `--save PATH` also writes the executed notebook.
Exits non-zero when a cell fails. The runner itself is `tools/nbrun.py` (the notebook tests use it too).
"""

import argparse
import os
import sys

from tools.nbrun import execute_notebook, render

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "notebooks", "quickstart.ipynb")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", nargs="?", default=NOTEBOOK, help="default: notebooks/quickstart.ipynb")
    parser.add_argument("--save", metavar="PATH", help="also write the executed notebook here")
    args = parser.parse_args(argv)

    print(f"Running {os.path.relpath(args.notebook)} in a fresh kernel...\n", flush=True)
    nb, failed = execute_notebook(args.notebook)
    print(render(nb), end="")
    if args.save:
        import nbformat

        nbformat.write(nb, args.save)
        print(f"(executed notebook written to {args.save})")
    if failed is not None:
        print(f"A cell failed:\n{failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
