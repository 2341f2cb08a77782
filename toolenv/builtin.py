"""The built-in tools by name: the one table the runner (instances) and the syntaxes
(what the model is told) read. A built-in tool class carries what is its own: its
``from_config(tools_section, run_dir, cache_dir)`` and, optionally, ``canonical(args)``,
the form of its arguments the result cache keys on (toolenv/base.py). docs/extending.md
shows how to add one."""

from __future__ import annotations

from toolenv.python_tool import PythonTool
from toolenv.search import SearchTool

BUILTIN_TOOLS: dict[str, type] = {"python": PythonTool, "search": SearchTool}


def builtin_class(name: str) -> type:
    """The class of the built-in tool ``name`` (a ``tools.enabled`` entry)."""
    try:
        return BUILTIN_TOOLS[name]
    except KeyError:
        raise ValueError(f"tools.enabled: unknown tool {name!r} "
                         f"(known: {', '.join(BUILTIN_TOOLS)})") from None
