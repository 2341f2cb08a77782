"""The run folder's layout, shared by the launcher, the learner, the actors and the jobs.

    RUN_DIR/config.yaml        the resolved config every process reads
    RUN_DIR/state.json         the learner's run state after every step (``RUN_STATE``)
    RUN_DIR/processes.json     role -> pid of the launcher's processes
    RUN_DIR/exits/PID.json     how a role process ended: its exit code (``record_exit``)
    RUN_DIR/checkpoints/       step-NNNNNNNN folders and the ``latest`` pointer

The checkpoint folders themselves are written by learner/checkpoint.py; everyone else only
needs to find the newest complete one (``latest_checkpoint``)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from arpo_async.core.files import atomic_write_json, read_json

log = logging.getLogger("arpo_async.core.rundir")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "trainer_state.json"
RUN_STATE = "state.json"  # RUN_DIR/state.json: the learner's view after every step
EXITS = "exits"
_NAME = re.compile(r"^step-(\d{8})$")
PARTIAL = ".partial-"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint folder is complete when its metadata (written last) parses."""
    return _NAME.match(path.name) is not None and read_json(path / META) is not None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and is_complete(p)),
                  key=lambda p: p.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None.

    ``latest`` names it too; after a crash between the folder's rename and the pointer
    update the pointer is one behind, which is logged (the folder is complete either way:
    its metadata is written and fsynced before the rename)."""
    found = complete_checkpoints(run_dir)
    newest = found[-1] if found else None
    try:
        name = (checkpoints_dir(run_dir) / LATEST).read_text().strip()
    except OSError:
        name = ""
    if newest is not None and name != newest.name:
        log.warning("checkpoint pointer %s names %r; the newest complete checkpoint is %s",
                    checkpoints_dir(run_dir) / LATEST, name, newest.name)
    return newest


def saved_position(run_dir: str | Path, stream: int) -> int:
    """Where stream ``stream`` (an actor id) should continue: the data position the
    learner last recorded for it in ``RUN_DIR/state.json`` (the earliest prompt the actor
    had not yet delivered, from its heartbeats), or 0 for a new run.

    A restarted actor therefore draws again the prompts it had in flight when it died
    (none skipped; a few delivered ones may repeat)."""
    path = Path(run_dir) / RUN_STATE
    try:
        value = json.loads(path.read_text()).get("data_position", {}).get(str(stream), 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return int(value) if isinstance(value, (int, float)) and value >= 0 else 0


def record_exit(run_dir: str | Path, pid: int, code: int) -> None:
    """Say how role process ``pid`` ends, for a launcher that cannot wait on it (one that
    adopted the process after ``--resume``): ``RUN_DIR/exits/PID.json``."""
    atomic_write_json(exit_record(run_dir, pid), {"pid": pid, "code": int(code)})


def exit_record(run_dir: str | Path, pid: int) -> Path:
    return Path(run_dir) / EXITS / f"{pid}.json"


def recorded_exit(run_dir: str | Path, pid: int) -> int | None:
    """The exit code ``record_exit`` wrote for process ``pid``, else None."""
    rec = read_json(exit_record(run_dir, pid)) or {}
    code = rec.get("code")
    return code if rec.get("pid") == pid and isinstance(code, int) else None
