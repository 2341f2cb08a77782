"""Loading the classes named in ``tools.custom`` (``module:Class``) and checking that they
follow the tool protocol of toolenv/base.py, before anything starts.

``check_custom_tools`` runs where a run is resolved (the launcher's preflight,
``--dry-run``, the pipeline), so a bad entry stops it with one line naming
``tools.custom[i]`` and the path before any process starts; evaluation and SFT meet the
same error when they build their tools. Only the class is inspected here (attributes,
signatures); it is instantiated by ``toolenv.runner.build_tools``. Its ``parameters``
must be a schema jsonschema can check calls against (``schema_problem``, which the
``tools.mcp`` tools' schemas meet too): one it cannot use would fail the hermes syntax's
check of each call instead.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

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
    problem = schema_problem(params)
    if problem:
        return f"parameters: a JSON schema that calls cannot be checked against: {problem}"
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


def schema_problem(schema: Any) -> str:
    """Why jsonschema cannot check calls against ``schema`` ("" when it can): the
    metaschema's verdict, a pattern Python cannot compile, a local ``$ref`` that points
    nowhere, or what checking an empty object raises; each would otherwise raise in the
    middle of a rollout (toolenv/syntax.py, ``HermesSyntax.find_call``). Checked for the
    ``tools.custom`` classes here and for the ``tools.mcp`` tools when their server lists
    them (toolenv/mcp_tools.py)."""
    import jsonschema  # jsonschema: heavy (about 0.5 s), for tool schemas only
    from referencing import Registry
    from referencing.jsonschema import specification_with

    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return 'not a JSON schema of type "object"'
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        patterns, refs = _walk(schema)
        for pattern in patterns:
            re.compile(pattern)
        spec = specification_with(cls.META_SCHEMA.get("$schema", ""))
        resolver = Registry().resolver_with_root(spec.create_resource(schema))
        for ref in refs:
            resolver.lookup(ref)
        cls(schema).is_valid({})
    except Exception as exc:  # SchemaError, re.error, Unresolvable, UnknownType, ...
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return ""


_DATA = ("const", "default", "enum", "examples")  # values, not schemas: never walked


def _walk(node: Any) -> tuple[list[str], list[str]]:
    """The ``pattern`` values and ``patternProperties`` keys, and the local ``$ref``s,
    anywhere in a schema."""
    patterns: list[str] = []
    refs: list[str] = []
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                patterns += list(node["patternProperties"])
            if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
                refs.append(node["$ref"])
            stack += [v for k, v in node.items() if k not in _DATA]
    return patterns, refs


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
