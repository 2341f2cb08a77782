"""A small MCP server for the tests (tests/integration/test_mcp_tools.py and
test_mcp_hardening.py): two tools, one slow and one that fails. ``python mcp_server.py``
serves over stdio; ``--http PORT`` serves streamable HTTP at http://127.0.0.1:PORT/mcp.

Misbehaving on request (the hardening tests), flags before the others:
``--misbehave`` adds tools that write a byte that is not UTF-8 to stdout (``garbage``),
answer with a text of any size (``big``) or stop the whole process (``stall``);
``--bad-schema KIND`` gives ``slow`` an input schema jsonschema cannot use;
``--exit-at-start CODE`` writes a line to stderr and exits before serving."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("testsrv", log_level="WARNING")
# The SDK's stdio server sends fd 1 to stderr and speaks over a private duplicate (so a
# stray print cannot corrupt the stream); garbage writes to the wire through its own.
WIRE = os.dup(1)
BAD_SCHEMAS = {
    "pattern": {"type": "object", "properties": {"text": {"type": "string", "pattern": "(?P<"}}},
    "type": {"type": "object", "properties": {"text": {"type": "strin"}}},
    "ref": {"type": "object", "properties": {"text": {"$ref": "#/$defs/nowhere"}}},
}


@server.tool()
async def slow(text: str, seconds: float = 0.0) -> str:
    """Return the text in upper case, after sleeping the given seconds."""
    await asyncio.sleep(seconds)
    return text.upper()


@server.tool()
def fails(mode: str = "error") -> str:
    """Fail: mode 'error' returns an error result, mode 'exit' ends the server's process."""
    if mode == "exit":
        os._exit(3)
    raise ToolError(f"asked to fail ({mode})")


def garbage(text: str) -> str:
    """Write a line holding bytes that are not UTF-8 to stdout, then answer the text."""
    os.write(WIRE, b"\xff\xfe not utf-8\n")
    return text


def big(chars: int) -> str:
    """A text of this many characters."""
    return "x" * chars


def stall() -> str:
    """Stop the whole process (SIGSTOP): it neither reads nor answers any more."""
    os.kill(os.getpid(), signal.SIGSTOP)
    return "never"


def _options(argv: list[str]) -> list[str]:
    while argv and argv[0] in ("--misbehave", "--bad-schema", "--exit-at-start"):
        flag = argv.pop(0)
        if flag == "--misbehave":
            for fn in (garbage, big, stall):
                server.add_tool(fn)
        elif flag == "--bad-schema":
            server._tool_manager.get_tool("slow").parameters = BAD_SCHEMAS[argv.pop(0)]
        else:
            print("testsrv: refusing to start (asked to)", file=sys.stderr, flush=True)
            sys.exit(int(argv.pop(0)))
    return argv


if __name__ == "__main__":
    args = _options(sys.argv[1:])
    if len(args) == 2 and args[0] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(args[1]))
    else:
        server.run()
