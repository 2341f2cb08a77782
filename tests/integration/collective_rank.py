"""One learner rank for tests/integration/test_collective_deadline.py: it joins the group
as the learner does (``learner.dist.init_distributed`` with
``learner.collective_timeout_s`` = argv[1]), gathers the ranks' hosts, and then rank 1
stops itself (SIGSTOP: alive, its sockets open, silent) while rank 0 runs the next
collective that needs it. Rank 0 prints how long that took and ``failure_line``, and ends as
``learner.main`` ends a failed rank (``exit_after_failure``)."""

from __future__ import annotations

import os
import signal
import sys
import time

from arpo_async.core.config import load_config
from learner.dist import exit_after_failure, failure_line, init_distributed, rank_hosts


def main() -> int:
    cfg = load_config(None, [f"learner.collective_timeout_s={sys.argv[1]}"])
    init_distributed(cfg)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = rank_hosts(world)  # both alive: this one completes
    print(f"joined {hosts}", flush=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0
    t0 = time.monotonic()
    try:
        rank_hosts(world)  # needs rank 1, which is stopped
    except Exception as exc:
        print(f"failed after {time.monotonic() - t0:.1f} s", flush=True)
        print(failure_line(exc, rank, hosts, cfg.learner.collective_deadline_s), flush=True)
        exit_after_failure(3)  # as learner.main does: the broken group aborts at exit
    print("completed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
