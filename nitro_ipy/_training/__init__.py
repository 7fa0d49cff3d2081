"""Training a handle: the programs it traces, the step guard, compile ahead, the step loop and its input
pipeline, runs and history, progress, checkpoints, and the `Nitro` handle that owns them.

May import every package below it (`_base`, `_closure`, `_experiment`, `_compiler`); never `_notebook`.
"""
