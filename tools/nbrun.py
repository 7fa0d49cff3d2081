"""Run a notebook headless in a real Jupyter kernel and read its outputs as text.

`demo.py` prints `notebooks/quickstart.ipynb` this way, and the kernel and notebook tests start their
kernels and read their outputs with the same code:

- `kernel_manager()`: a `KernelManager` for an ipykernel on this very Python (a throwaway kernelspec);
- `execute_notebook(path)`: the executed notebook and the failing cell's error, if any;
- `render(nb)`: what a reader sees, as text (markdown, sources, text outputs; closed widgets left out).

It lives beside the package, not in it: it is the repository's tooling (demo and tests), not something a
nitro_ipy user calls, and it needs nbclient and nbformat, which only the `test` extra installs.
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile
import textwrap

KERNEL_NAME = "nitro-ipy-python"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@contextlib.contextmanager
def kernel_manager():
    """A `KernelManager` for an ipykernel running on *this* Python (`sys.executable -m ipykernel_launcher`).

    It uses a throwaway kernelspec, so it needs no `jupyter kernelspec install` and cannot pick up a
    `python3` spec that points at another interpreter. The kernel is not started here.
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_root = tempfile.mkdtemp(prefix="nitro-ipy-kernels-")
    try:
        spec_dir = os.path.join(spec_root, KERNEL_NAME)
        os.makedirs(spec_dir)
        # `-Xfrozen_modules=off` and the log level keep two start-up warnings about the debugger and the
        # unencrypted local TCP transport out of the output; kernel errors still print.
        argv = [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}",
                "--log-level=ERROR"]
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump({"argv": argv, "display_name": "nitro_ipy demo", "language": "python"}, f)
        yield KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[spec_root]))
    finally:
        shutil.rmtree(spec_root, ignore_errors=True)


def execute_notebook(path: str, timeout: int = 600):
    """Execute the notebook at `path` in a fresh kernel started in its directory.

    Returns `(nb, error)`: the executed `NotebookNode` (outputs up to the failing cell, if one failed)
    and the `CellExecutionError`, or None.
    """
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    folder = os.path.dirname(os.path.abspath(path))
    with kernel_manager() as km:
        client = _client_class()(nb, km=km, timeout=timeout, store_widget_state=True,
                                 resources={"metadata": {"path": folder}})
        try:
            client.execute()
        except CellExecutionError as err:
            return nb, err
        finally:
            # nbclient shuts down only a kernel manager it made: this one's kernel would live until the
            # process exits, and leave its connection file behind
            if client.kc is not None:
                client.kc.stop_channels()
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    return nb, None


def _client_class():
    from nbclient import NotebookClient

    class Client(NotebookClient):
        """nbclient keeps the state of widgets the kernel closed; a notebook front end drops their views
        (the progress bars, closed when their epoch ends). Forget them, so the saved state says which
        widget views are still on screen."""

        def handle_comm_msg(self, outs, msg, cell_index):
            super().handle_comm_msg(outs, msg, cell_index)
            if msg["msg_type"] == "comm_close":
                self.widget_state.pop(msg["content"]["comm_id"], None)
                self.widget_buffers.pop(msg["content"]["comm_id"], None)

        def set_widgets_metadata(self):
            super().set_widgets_metadata()
            self.nb.metadata.setdefault("widgets", {WIDGET_STATE: {"state": {}, "version_major": 2,
                                                                   "version_minor": 0}})

    return Client


def live_widgets(nb) -> set | None:
    """Model ids of the widgets still open when the run ended (None if no widget state was saved)."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE)
    return None if state is None else set(state.get("state", {}))


def output_text(output, live: set | None = None) -> str | None:
    """What a reader sees of one output as text, or None for a widget that was closed (a finished bar)."""
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind == "error":
        return f"{output.get('ename')}: {output.get('evalue')}\n"
    if kind in ("display_data", "execute_result"):
        data = output.get("data", {})
        view = data.get(WIDGET_VIEW)
        if view is not None and live is not None and view.get("model_id") not in live:
            return None
        text = data.get("text/plain")
        return None if text is None else text + "\n"
    return None


def render(nb) -> str:
    """The executed notebook as a reader would follow it, as text: markdown, then sources and outputs."""
    live = live_widgets(nb)
    out = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            out.append(textwrap.indent(cell.source, "# ", lambda line: True).rstrip() + "\n")
            continue
        if cell.cell_type != "code":
            continue
        out.append(f"In [{cell.get('execution_count') or ' '}]:")
        out.append(textwrap.indent(cell.source, "    ").rstrip())
        texts = [t for t in (output_text(o, live) for o in cell.get("outputs", [])) if t]
        if texts:
            out.append("".join(texts).rstrip())
        out.append("")
    return "\n".join(out) + "\n"
