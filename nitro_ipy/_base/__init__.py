"""The floor every other package stands on: errors, memos, the world counter, JAX compatibility, what is
user code (`_origin`), content fingerprints, sharding helpers, the live code (`_live`), report lines and
their HTML, files written whole and the temp files killed writers left (`_writes`).

Imports nothing else of nitro_ipy. Every sibling may import it.
"""
