"""Learner entry point: ``python -m learner.main --config RUN_DIR/config.yaml [--resume]``,
one process per rank (torchrun sets RANK/WORLD_SIZE; a single rank needs no launcher).

torch and DeepSpeed are imported only after the arguments are parsed, so ``--help`` is
instant; the loop itself is learner/loop.py.
"""

from __future__ import annotations

import argparse
import logging
import os

from arpo_async.core.config import load_config
from arpo_async.core.protocol import ExitCode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="learner.main", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in RUN_DIR/checkpoints")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from learner.loop import LearnerLoop  # it imports torch: not for --help

    cfg = load_config(args.config)
    cfg.run.apply_log_level()
    loop = None
    try:
        loop = LearnerLoop(cfg, resume=args.resume)
        loop.run()  # the process group is left at exit (learner/dist.py init_distributed)
    except Exception as exc:  # one line naming rank and hosts, then the traceback
        from learner.dist import exit_after_failure, failure_line

        rank = int(os.environ.get("RANK", "0"))
        hosts = loop.hosts if loop is not None else []
        log = logging.getLogger("learner")
        log.error(failure_line(exc, rank, hosts, cfg.learner.collective_deadline_s))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a broken group aborts at exit
            log.exception("learner rank %d traceback", rank)
            exit_after_failure(ExitCode.FAILED)
        raise
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a rank that ended well leaves its group, then ends without the interpreter's
        # exit, where gloo's destructors can still abort it (a peer leaving at once)
        from learner.dist import close_distributed, exit_after_failure

        try:
            close_distributed()
        except Exception as exc:  # the run is done: leaving is best effort
            logging.getLogger("learner").warning("leaving the process group: %s", exc)
        exit_after_failure(ExitCode.OK)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
