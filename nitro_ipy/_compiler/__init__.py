"""Compiled programs, whatever asked for them: the module-level cache (keys, entries, stats), tracing and
compiling, miss explanations, the program store on disk (and JAX's
persistent cache inside it: `_xla`), trace reuse, and the `%nitro_stats` table.

May import `_base` and `_closure`; knows nothing of experiments or handles (`_experiment`, `_training`).
"""
