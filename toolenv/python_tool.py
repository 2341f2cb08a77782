"""The Python interpreter tool: runs a model's code in the sandbox and reports what it printed.

Like the reference ARPO tool, a bare expression as the last statement is shown the way
the REPL shows it (its repr, unless None), so ``6*7`` gives ``42``. Output (stdout and
stderr interleaved) is capped at ``max_output`` characters; past the cap the run is
stopped. Errors carry the last lines of the traceback (frames of the sandbox's own
runner are dropped, and the offending source line is shown).

The interpreter is this process's own (``sys.executable``), so the sandbox offers the
same packages (numpy, sympy, ...); its installation and virtual environment are bound
back read-only inside the hidden folders, and nothing else of the project is visible.
``hide`` adds folders to hide (``build_tools`` passes the run and cache folders).

At construction the tool probes which isolation works here (``sandbox`` describes the
modes) and logs a warning for anything missing: no bwrap is an error unless
``allow_unsandboxed``, in which case every start-up logs an ``UNSANDBOXED`` warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from toolenv.base import ToolResult
from toolenv.sandbox import Limits, Sandbox, SandboxRun, default_hidden

log = logging.getLogger(__name__)

_FILE_BYTES = 16 << 20  # largest file a snippet may write in its scratch folder
_RESULT_VERSION = "1"  # bump when the text of results would change

# Runs inside the sandbox (python -c); the snippet arrives on stdin.
_RUNNER = r"""
import ast, linecache, sys, traceback
def _arpo_run():
    src = sys.stdin.buffer.read().decode("utf-8", "replace")
    linecache.cache["<code>"] = (len(src), None, src.splitlines(True), "<code>")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(src, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), scope)
        if last is not None:  # REPL-style display of a final bare expression
            exec(compile(ast.Interactive(body=[last]), "<code>", "single"), scope)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        sys.stdout.flush()
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb, limit=-8)))
        sys.stderr.flush()
        raise SystemExit(1)
_arpo_run()
"""

# Start-up probe: what the sandbox actually isolates, as JSON.
_PROBE = r"""
import json, os, socket, sys
hidden, exposed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def visible(path):
    keep = {e[len(path) + 1:].split("/")[0] for e in exposed if e.startswith(path + "/")}
    try:
        return [n for n in os.listdir(path) if n not in keep]
    except OSError:
        return []
net = True
try:
    socket.create_connection(("1.1.1.1", 80), timeout=1).close()
except OSError:
    net = False
print(json.dumps({"uid": os.getuid(), "network": net,
                  "visible": {p: visible(p)[:5] for p in hidden if visible(p)}}))
"""


def _interpreter_roots(python: str) -> list[str]:
    """Folders the interpreter needs: its installation and its virtual environment."""
    if python == sys.executable:
        roots = {sys.prefix, sys.base_prefix}
    else:
        roots = {str(Path(python).parent.parent), str(Path(python).resolve().parent.parent)}
    return sorted({os.path.realpath(r) for r in roots})


class PythonTool:
    """``<python>code</python>``: run code in a fresh sandbox, return what it printed."""

    name = "python"

    def __init__(self, cpu_s: int = 5, memory_mb: int = 512, max_procs: int = 32,
                 max_output: int = 4096, wall_timeout_s: float = 10.0,
                 allow_unsandboxed: bool = False, *, python: str | None = None,
                 isolation: str = "auto", hide: Sequence[str | Path] = ()):
        for key, value in (("cpu_s", cpu_s), ("memory_mb", memory_mb),
                           ("max_procs", max_procs), ("max_output", max_output),
                           ("wall_timeout_s", wall_timeout_s)):
            if value <= 0:
                raise ValueError(f"PythonTool {key} must be > 0, got {value}")
        self.python = python or sys.executable
        self.hide = default_hidden(hide)
        self.cpu_s, self.max_output, self.wall_timeout_s = cpu_s, max_output, wall_timeout_s
        py_version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        self.version = f"{_RESULT_VERSION}:py{py_version}:out{max_output}"
        limits = Limits(cpu_s=cpu_s, memory_bytes=memory_mb << 20, max_procs=max_procs,
                        file_bytes=_FILE_BYTES)
        self.sandbox, self.warnings = self._choose(limits, isolation, allow_unsandboxed)
        for warning in self.warnings:
            log.warning("python tool: %s", warning)

    # ------------------------------------------------------------------ start-up probe

    def _make(self, mode: str, limits: Limits) -> Sandbox:
        env = {"PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin",
               "PYTHONHASHSEED": "0",  # same snippet, same output: results are cached
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "MPLBACKEND": "Agg", "MPLCONFIGDIR": "/tmp"}
        return Sandbox(mode, limits, expose=_interpreter_roots(self.python), hide=self.hide,
                       env=env)

    def _choose(self, limits: Limits, isolation: str,
                allow_unsandboxed: bool) -> tuple[Sandbox, list[str]]:
        if isolation not in ("auto", "setuid", "userns"):
            raise ValueError(f"isolation must be auto, setuid or userns, got {isolation!r}")
        failures: list[str] = []
        if shutil.which("bwrap") is None:
            failures.append("bubblewrap (bwrap) is not installed")
        else:
            modes = [isolation] if isolation != "auto" else (
                ["setuid", "userns"] if os.geteuid() == 0 else ["userns"])
            for mode in modes:
                sandbox = self._make(mode, limits)
                missing, error = self._probe(sandbox)
                if not error:
                    return sandbox, missing
                failures.append(f"{mode} mode failed: {error}")
        reason = "; ".join(failures)
        if not allow_unsandboxed:
            hint = ("install bubblewrap (apt-get install bubblewrap)" if "not installed" in reason
                    else "see toolenv/sandbox.py for what each mode needs")
            raise RuntimeError(f"python tool cannot sandbox code: {reason}. Fix: {hint}, or set "
                               "tools.allow_unsandboxed=true to run code without one (unsafe)")
        warning = (f"UNSANDBOXED: model-written code runs with only rlimits, with access to "
                   f"this machine's files and network ({reason})")
        return self._make("none", limits), [warning]

    def _probe(self, sandbox: Sandbox) -> tuple[list[str], str]:
        """(missing isolation, error that makes the mode unusable)."""
        args = [json.dumps(list(sandbox.hide)), json.dumps(list(sandbox.expose))]
        run = sandbox.run_sync([self.python, "-s", "-c", _PROBE, *args], timeout_s=30)
        text = run.output.decode("utf-8", "replace").strip()
        if run.returncode != 0:
            return [], f"exit {run.returncode}: {text[-500:]}"
        try:
            facts = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            return [], f"unreadable probe output: {text[-500:]!r}"
        missing = []
        if facts["uid"] == 0:
            missing.append("code runs as root inside the sandbox")
        if facts["network"]:
            missing.append("the network is reachable from the sandbox")
        for path, names in facts["visible"].items():
            missing.append(f"hidden folder {path} is visible (e.g. {names})")
        return missing, ""

    # ------------------------------------------------------------------ calls

    async def call(self, args: str) -> ToolResult:
        run = await self.sandbox.run([self.python, "-s", "-u", "-c", _RUNNER],
                                     args.encode("utf-8"), self.wall_timeout_s,
                                     max_bytes=4 * self.max_output)
        return self._result(run)

    def _result(self, run: SandboxRun) -> ToolResult:
        text = run.output.decode("utf-8", "replace")
        if run.truncated:  # stopped for the size of its output, not for an error
            return ToolResult(self._clip(text, keep_tail=False), ok=True, latency_s=run.wall_s)
        text, code = text.rstrip(), run.returncode
        if code == 0:
            return ToolResult(self._clip(text, keep_tail=False), ok=True, latency_s=run.wall_s)
        # Errors keep the end of the output, where the traceback is.
        text = self._clip(text, keep_tail=True)
        if run.timed_out:
            note = f"TimeoutError: execution exceeded the {self.wall_timeout_s:g} s time limit"
            return self._error(text, note, "timeout", run)
        if text.startswith(("bwrap:", "prlimit:", "setpriv:")):
            return self._error(text, "", "sandbox", run)
        if code == 1:
            return self._error(text, "", "exception", run)
        signum = -code if code < 0 else code - 128 if code > 128 else 0
        if signum:
            return self._error(text, self._signal_text(signum), "killed", run)
        return self._error(text, f"exit code {code}", "exit_code", run)

    def _clip(self, text: str, keep_tail: bool) -> str:
        if len(text) <= self.max_output:
            return text
        marker = f"[output truncated at {self.max_output} characters]"
        if keep_tail:
            return f"... {marker}\n{text[-self.max_output:]}"
        return f"{text[: self.max_output]}\n... {marker}"

    @staticmethod
    def _error(text: str, note: str, kind: str, run: SandboxRun) -> ToolResult:
        full = f"{text}\n{note}" if text and note else text or note
        return ToolResult(full, ok=False, latency_s=run.wall_s, error=kind)

    def _signal_text(self, signum: int) -> str:
        if signum == signal.SIGXCPU:
            return f"Killed: CPU time limit of {self.cpu_s} s exceeded"
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        if signum == signal.SIGKILL:
            return f"Killed ({name}: CPU hard limit, memory or a process limit)"
        return f"Killed ({name})"

    async def close(self) -> None:
        """Nothing persists between calls: every call has its own sandbox."""
