"""Example tools for ``tools.custom`` (docs/tools.md)."""
