"""Loading the classes named in ``tools.custom`` (``module:Class``) and checking that they
follow the tool protocol of toolenv/base.py, before anything starts.

``check_custom_tools`` runs where a run is resolved (the launcher's preflight,
``--dry-run``, the pipeline), so a bad entry stops it with one line naming
``tools.custom[i]`` and the path before any process starts; evaluation and SFT meet the
same error when they build their tools. Only the class is inspected here (attributes,
signatures); it is instantiated by ``toolenv.runner.build_tools``.
"""

from __future__ import annotations

import importlib
import inspect

from toolenv.tags import RESERVED, TAG_NAME


def load_tool_class(path: str) -> type:
    """The class at ``module:Class``; ValueError naming what is wrong otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("expected module:Class")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user's module may fail in any way while importing
        raise ValueError(f"cannot import {module_name} ({type(exc).__name__}: {exc})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name} has no {attr}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ValueError(f"{attr} is not a class")
    problem = tool_class_problem(obj)
    if problem:
        raise ValueError(f"{attr} does not follow the tool protocol (toolenv/base.py): {problem}")
    return obj


def tool_class_problem(cls: type) -> str:
    """What keeps ``cls`` from being a tool, or "" when nothing does."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not TAG_NAME.fullmatch(name):
        return f"name must be a str like {TAG_NAME.pattern} (got {name!r})"
    if name in RESERVED:
        return f"name {name!r} is reserved ({', '.join(sorted(RESERVED))})"
    if not isinstance(getattr(cls, "description", None), str) or not cls.description.strip():
        return "description must be a non-empty str"
    params = getattr(cls, "parameters", None)
    if (not isinstance(params, dict) or params.get("type") != "object"
            or not isinstance(params.get("properties"), dict)):
        return 'parameters must be a JSON schema {"type": "object", "properties": {...}}'
    if not hasattr(cls, "version"):
        return "no version (a str, part of the result cache key)"
    version = inspect.getattr_static(cls, "version")
    if not isinstance(version, (str, property)):
        return f"version must be a str (got {type(version).__name__})"
    if not inspect.iscoroutinefunction(getattr(cls, "call", None)):
        return "call must be an async method: async def call(self, args: str) -> ToolResult"
    try:
        inspect.signature(cls).bind()
    except TypeError:
        return "the class must be constructible without arguments"
    except ValueError:  # no signature to read (a C type): let construction tell
        pass
    return ""


def custom_tool_names(paths: list[str], enabled: list[str]) -> list[str]:
    """Names of the ``tools.custom`` classes; ValueError ("tools.custom[i]=PATH: ...")
    on a bad path, a class that is not a tool, or a name already taken."""
    taken = {name: f"tools.enabled ({name})" for name in enabled}
    names = []
    for i, path in enumerate(paths):
        where = f"tools.custom[{i}]={path}"
        try:
            name = load_tool_class(path).name
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if name in taken:
            raise ValueError(f"{where}: tool name {name!r} is already taken by {taken[name]}")
        taken[name] = f"tools.custom ({path})"
        names.append(name)
    return names


def check_custom_tools(tools) -> None:
    """``tools.custom`` of a ``ToolsConfig``, imported and checked; ValueError naming
    ``tools.custom[i]`` and the path otherwise."""
    custom_tool_names(tools.custom, tools.enabled)
