"""`%load_ext nitro_ipy`: wires a `NitroMagics` (which owns the extension's state) into a shell.

`load` registers the magics and their cell callbacks, then starts them (the rich message sink in a widget
kernel, the file watcher); `unload` removes every callback and the magics and closes them. Loading again
(twice, or `%reload_ext`) first removes what an earlier load left, so exactly one set is ever registered.
The current load is found through IPython's own magics registry: this module keeps no state.
"""

from .._base import _world
from ._magics import CELL_EVENTS, NitroMagics, is_cell_callback


def load(ip) -> None:
    """Register nitro_ipy's magics and cell callbacks in `ip`, replacing an earlier load's."""
    unload(ip)
    magics = NitroMagics(ip)
    ip.register_magics(magics)
    for event in CELL_EVENTS:
        ip.events.register(event, getattr(magics, event))
    magics.start()


def unload(ip) -> None:
    """Remove every cell callback and the magics from `ip`; close the sink, the panel and the watcher."""
    # Also callbacks whose magics are gone from the registry (an earlier copy of `_magics`, say).
    for event in CELL_EVENTS:
        for fn in list(ip.events.callbacks.get(event, ())):
            if is_cell_callback(fn):
                ip.events.unregister(event, fn)
    _world.cell_ended()  # unloaded by a cell, whose post-cell hook is gone: no cell is running for us now
    magics = loaded_magics(ip)
    if magics is None:
        return
    # IPython has no `unregister_magics`; remove exactly the entries that point at this instance.
    table = ip.magics_manager.magics["line"]
    for name in magics.magics["line"]:
        if getattr(table.get(name), "__self__", None) is magics:
            del table[name]
    del ip.magics_manager.registry[type(magics).__name__]
    magics.close()


def loaded_magics(ip):
    """The `NitroMagics` of the load in effect in `ip`, or None when nitro_ipy is not loaded there."""
    magics = ip.magics_manager.registry.get(NitroMagics.__name__)
    # By module, not `isinstance`: an instance made before an `importlib.reload` of `_magics` counts too.
    return magics if type(magics).__module__ == NitroMagics.__module__ else None
