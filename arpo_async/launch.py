"""``python -m arpo_async.launch [--config FILE] [key=value ...]``: start a run.

Resolves the config once (ports, model folder) and writes ``RUN_DIR/config.yaml``;
starts the learner (torchrun when ``learner.world_size`` > 1) and ``actors.num`` actors as
separate processes; shows progress; restarts a dead actor with backoff up to
``actors.max_restarts`` times, and a dead learner from its newest checkpoint up to
``learner.max_restarts`` times; stops everything cleanly on Ctrl-C or when the learner
finishes; exits non-zero, naming the role and its last log lines, when a role fails.

``--resume RUN_DIR`` continues a run whose launcher died: the learner restores its newest
checkpoint (weights, optimizer, policy version, ledger, data positions), the actors of
RUN_DIR that are still running are adopted and reconnect, the missing ones are started;
``metrics.jsonl`` goes on in the same file. Events: ``RUN_DIR/events.jsonl``.

With ``pipeline.enabled`` (configs/default.yaml) the launcher runs the whole job around
RL: synthetic suite and model, cold-start SFT, evaluation before and after RL, summary
and plots (arpo_async/jobs/pipeline.py); ``--resume`` then skips the finished stages.

``--dry-run`` validates the config and prints the process plan (arpo_async/launcher/plan.py).
``python -m arpo_async.launch actor --connect tcp://HOST:PORT [--actor-id I] [--keys DIR]``
runs one actor on another machine, with the config it gets from the learner
(arpo_async/launcher/remote.py, docs/scale-out.md).

``--slurm [--nodes-learner N --nodes-actors M] [--emit FILE]`` writes an sbatch script in
which Slurm places the learner ranks and the actors, and submits it unless ``--emit``
(arpo_async/launcher/slurm.py; docs/design.md, "Beyond one machine").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from arpo_async.core.config import ConfigError, describe
from arpo_async.launcher.plan import dry_run
from arpo_async.launcher.remote import main as actor_main
from arpo_async.launcher.slurm import run_slurm, slurm_request
from arpo_async.launcher.supervisor import LaunchRequest, launch, load

EPILOG = "config keys (set any with key=value):\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arpo_async.launch", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG + "\n".join(describe()))
    p.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and print the process plan; start nothing")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest checkpoint")
    p.add_argument("--quiet", action="store_true", help="plain log lines, no live panel")
    slurm = p.add_argument_group("Slurm (arpo_async/launcher/slurm.py)")
    slurm.add_argument("--slurm", action="store_true",
                       help="write an sbatch script in which Slurm places the learner and the "
                       "actors, and submit it (RUN_DIR/slurm.sbatch)")
    slurm.add_argument("--nodes-learner", type=int, default=1, metavar="N",
                       help="nodes for the learner ranks (default 1)")
    slurm.add_argument("--nodes-actors", type=int, default=1, metavar="M",
                       help="nodes for the actors, actors.num / M on each (default 1)")
    slurm.add_argument("--emit", metavar="FILE", help="write the script to FILE, do not submit")
    slurm.add_argument("--partition", default="", help="sbatch --partition for both parts")
    slurm.add_argument("--time", default="", help="sbatch --time limit, e.g. 04:00:00")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["actor"]:  # an actor on another machine (arpo_async/launcher/remote.py)
        return actor_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.emit and not args.slurm:
        print("--emit writes a Slurm script: pass --slurm too", file=sys.stderr)
        return 2
    # The jobs load the engines' clients and aiohttp (0.4 s): --help and `actor` need none.
    from arpo_async.jobs.pipeline import USER_CONFIG
    from arpo_async.jobs.pipeline import run as run_pipeline
    from arpo_async.jobs.preflight import prepare_run, resolve_run

    try:
        if args.slurm:
            return run_slurm(args, resolve_run(slurm_request(args)))
        req = LaunchRequest(config=args.config, overrides=args.overrides, resume=args.resume,
                            quiet=args.quiet, dry_run=args.dry_run)
        if args.dry_run:  # checked and prepared in its dry-run form: nothing is built
            cfg = load(req)
            cfg.check_trainable()
            prepare_run(cfg, dry_run=True)
            return dry_run(cfg, args.config or args.resume or "configs/default.yaml")
        if args.resume:  # a pipeline run folder has its job's config; else the RL stage's
            if (Path(args.resume) / USER_CONFIG).is_file():
                return run_pipeline(args)
            return launch(resolve_run(req), req)
        cfg = load(req)  # read once, whichever runs it
        if cfg.pipeline.enabled:
            return run_pipeline(args, cfg)
        return launch(resolve_run(req, cfg), req)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
