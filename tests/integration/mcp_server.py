"""A small MCP server for the tests (tests/integration/test_mcp_tools.py): two tools, one
slow and one that fails. ``python mcp_server.py`` serves over stdio; ``--http PORT``
serves streamable HTTP at http://127.0.0.1:PORT/mcp."""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("testsrv", log_level="WARNING")


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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
