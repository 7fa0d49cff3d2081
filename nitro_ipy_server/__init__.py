"""nitro_ipy's Jupyter server extension: a notebook saved while one of nitro_ipy's buttons is still live
is written with the button's static form, not its widget view.

nitro_ipy's **Rebuild handle** and **Stop** buttons are widgets only while they can act; once clicked or
retired their output becomes HTML. One saved in between (right after the cell that showed it, during a
background run, or by JupyterLab's autosave) would store a widget view, which a reopen on a fresh kernel
shows as "Error displaying widget: model not found": JupyterLab's widget renderer never falls back to an
output's other mime types. So each such output is marked in its metadata (`{"nitro_ipy": {"live": ...}}`)
and carries, beside the widget view, a `text/html` + `text/plain` form that says what it was when saved;
this pre-save hook drops the widget view of marked outputs from what is written to disk. The live page
keeps its live button (only the file changes), other libraries' widgets are never touched, and a notebook
with no marked output is saved exactly as sent.

Installing the package enables it (`etc/jupyter/jupyter_server_config.d/nitro_ipy.json`). It is a package
of its own, apart from `nitro_ipy`, so the server process imports neither JAX nor anything else of nitro_ipy.
"""

import logging

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MARK = "nitro_ipy"  # the output metadata key nitro_ipy's live buttons carry: {"live": "rebuild" | "stop"}
_STATIC = ("text/html", "text/plain")


def _jupyter_server_extension_points():
    return [{"module": "nitro_ipy_server"}]


def _load_jupyter_server_extension(serverapp):
    register = getattr(serverapp.contents_manager, "register_pre_save_hook", None)
    if register is None:  # jupyter_server < 2 has only the single `pre_save_hook` setting
        serverapp.log.warning("nitro_ipy: this jupyter_server has no register_pre_save_hook; a notebook saved "
                              "while a nitro_ipy button is live keeps its widget view")
        return
    register(pre_save_hook)
    serverapp.log.info("nitro_ipy: saved notebooks keep nitro_ipy's live buttons as their static form")


def live_outputs(nb: dict) -> list[dict]:
    """The outputs of `nb` (an nbformat 4 notebook as a dict) that are nitro_ipy live buttons: marked,
    holding a widget view and a static form to keep. Reads only; raises on a malformed notebook."""
    found = []
    for cell in nb.get("cells") or ():
        if cell.get("cell_type") != "code":
            continue
        for output in cell.get("outputs") or ():
            if output.get("output_type") not in ("display_data", "execute_result"):
                continue
            mark = (output.get("metadata") or {}).get(MARK)
            data = output.get("data") or {}
            if isinstance(mark, dict) and mark.get("live") and WIDGET_VIEW in data and all(k in data for k in _STATIC):
                found.append(output)
    return found


def strip_live_widgets(nb: dict) -> int:
    """Drop the widget view of each nitro_ipy live button in `nb`, in place, keeping its static form;
    returns how many. Every output is found before any is changed, so an error leaves `nb` as it was."""
    found = live_outputs(nb)
    for output in found:
        del output["data"][WIDGET_VIEW]
        output["metadata"][MARK] = dict(output["metadata"][MARK], saved=True)
    return len(found)


def pre_save_hook(model, path=None, contents_manager=None, **kwargs):
    """The contents manager's pre-save hook. Never raises: a failure is logged and the notebook is saved
    as sent (run_pre_save_hooks would log it too, but an `HTTPError` would refuse the save)."""
    if not isinstance(model, dict) or model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    log = getattr(contents_manager, "log", None) or logging.getLogger(__name__)
    try:
        count = strip_live_widgets(model["content"])
    except Exception:  # noqa: BLE001 - a save must never fail because of this hook
        log.warning("nitro_ipy: the pre-save hook failed on %s; saved unchanged", path, exc_info=True)
        return
    if count:
        log.debug("nitro_ipy: %s: %d live button(s) saved as their static form", path, count)
