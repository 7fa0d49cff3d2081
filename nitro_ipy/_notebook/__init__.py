"""Jupyter: the extension (cell callbacks), the magics, the widgets and the file watcher. The only package
that imports IPython, ipywidgets or watchdog; `import nitro_ipy` never imports it.

May import every package below it.
"""
