"""``python -m arpo_async.launch [--config FILE] [key=value ...]``: start a run.

Resolves the config once (ports, model folder) and writes ``RUN_DIR/config.yaml``;
starts the learner (torchrun when ``learner.world_size`` > 1) and ``actors.num`` actors as
separate processes; shows progress; restarts a dead actor with backoff up to
``actors.max_restarts`` times; stops everything cleanly on Ctrl-C or when the learner
finishes; exits non-zero, naming the role and its last log lines, when a role fails.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = "config keys (set any with key=value):\n"


def _parser() -> argparse.ArgumentParser:
    from arpo_async.config import describe

    p = argparse.ArgumentParser(
        prog="python -m arpo_async.launch", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG + "\n".join(describe()))
    p.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and print the process plan; start nothing")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument("--quiet", action="store_true", help="plain log lines, no live panel")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from arpo_async.config import ConfigError

    try:
        from arpo_async.supervisor import launch

        return launch(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
