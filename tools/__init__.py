"""The repository's own tooling (not part of the installed package)."""
