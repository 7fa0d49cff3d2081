"""The experiment contract: field markers and the compile view, hooks, the checks made at setup, the model
contract (params, state, static leaves), the flat parameter layout, the optimizer, splits and batches, and
binding an experiment to the live code (`_binding`, `_carry`).

May import `_base` and `_closure`. Imported by `_training` and `_notebook`; never by `_compiler`.
"""
