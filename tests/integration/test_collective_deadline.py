"""Every collective between learner ranks has a deadline (learner/dist.py,
``learner.collective_timeout_s``): two real gloo ranks joined as the learner joins them;
rank 1 is stopped (alive, sockets open, silent: what a host cut off or a frozen process
looks like to its peer) and rank 0's next collective fails within the deadline with a
line naming the ranks and their hosts, instead of hanging (torch's default is 30 min).
The stall is forced (rank 1 stops itself after the first collective), not waited for."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from arpo_async.core.ports import free_port
from tests.conftest import PY, REPO, python_env

pytestmark = [pytest.mark.integration]
DEADLINE_S = 4


def _wait_for(path, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = path.read_text() if path.exists() else ""
        if text in got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{path.name}: no {text!r} within {timeout_s:.0f} s: {got[-2000:]}")


def test_a_stalled_peer_fails_the_collective_within_the_deadline(tmp_path):
    base = python_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                           "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    procs, logs = [], [tmp_path / f"rank{r}.log" for r in (0, 1)]
    try:
        for rank in (1, 0):
            procs.append(subprocess.Popen(
                [PY, "-m", "tests.integration.collective_rank", str(DEADLINE_S)], cwd=REPO,
                env=base | {"RANK": str(rank)}, stdout=logs[rank].open("w"),
                stderr=subprocess.STDOUT))
        _wait_for(logs[1], "joined", 300)  # both joined: the first collective completed
        rank0 = procs[1]
        rank0.wait(timeout=300)
        out = logs[0].read_text()
        assert rank0.returncode == 3 and "completed" not in out, out[-2000:]
        took = float(re.search(r"failed after ([\d.]+) s", out).group(1))
        assert DEADLINE_S - 0.5 <= took <= DEADLINE_S + 30, out  # the deadline, not a hang
        line = re.search(r"learner rank 0 on (\S+) failed: .*", out).group(0)
        host = line.split()[4]
        assert f"(ranks: 0 on {host}, 1 on {host};" in line, line
        assert "learner.collective_timeout_s=4 s" in line, line
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
