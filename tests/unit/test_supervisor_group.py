"""What a role leaves in its process group when its own process dies is killed too
(arpo_async/launcher/supervisor.py): an actor killed outright left vLLM's engine core and
worker running, 1.5 GB each, one more at every restart."""

from __future__ import annotations

import os
import signal
import time

from arpo_async.launcher import supervisor


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_stopping_a_dead_role_kills_what_it_left_in_its_group(tmp_path):
    # the role's process starts a child in its group (as vLLM starts its engine), writes
    # the child's pid, then waits to be killed
    script = f'sleep 300 & echo $! > {tmp_path}/child; wait'
    role = supervisor.Role("actor0", ["sh", "-c", script], dict(os.environ),
                           tmp_path / "actor0.log")
    role.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    os.kill(role.proc.pid, signal.SIGKILL)  # the role's own process only
    role.proc.wait(10)
    assert _alive(child)  # the child lives on in the dead role's group
    role.stop()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the dead role's child still runs"
        time.sleep(0.05)
