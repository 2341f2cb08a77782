"""A custom tool for ``tools.custom=[examples.tools.calculator:Calculator]`` (docs/tools.md)."""

import ast
import operator

from toolenv.base import ToolResult

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


class Calculator:
    name = "calculator"  # the tag (<calculator>2+3</calculator>) and the Hermes name
    description = "Evaluate an arithmetic expression: + - * / and parentheses."
    parameters = {"type": "object", "required": ["expression"],
                  "properties": {"expression": {"type": "string", "description": "e.g. 2*(3+4)"}}}
    version = "1"  # bump when results would change (part of the cache key)

    async def call(self, args: str) -> ToolResult:
        def value(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](value(node.left), value(node.right))
            if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](value(node.operand))
            raise ValueError(f"not arithmetic: {ast.unparse(node)}")

        try:
            return ToolResult(str(value(ast.parse(args, mode="eval").body)), ok=True)
        except (SyntaxError, ValueError, ZeroDivisionError) as exc:
            return ToolResult(f"{type(exc).__name__}: {exc}", ok=False, error="bad_expression")
