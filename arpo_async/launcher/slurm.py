"""Slurm places the processes: ``python -m arpo_async.launch --slurm [--nodes-learner N]
[--nodes-actors M] [--emit FILE] [--partition P] [--time T] [--config F] [key=value ...]``.

Writes one sbatch script, a heterogeneous job: component 0 holds the learner's nodes,
component 1 the actors' nodes. Slurm starts the learner ranks (one ``torchrun`` per
learner node, node rank ``SLURM_NODEID``, rendezvous at the first learner node on
``cluster.master_port``, which so holds rank 0 and the sockets the actors connect to)
and one ``launch actor --connect`` srun step per actor, ``actors.num / M`` on each actor
node; nothing of ours reaches across machines. Before writing it, the config is resolved
once, as the launcher does: ``RUN_DIR/config.yaml``, the CurveZMQ keys in
``RUN_DIR/keys`` (created when missing: the learner binds ``0.0.0.0`` unless
``transport.host`` names an address) and the model folder, all on a path every node
shares. ``--emit FILE`` only writes the script; without it the script goes to
``RUN_DIR/slurm.sbatch`` and is submitted with ``sbatch``.

In the job, the actors fetch the config from the learner and exit when it ends the run;
the script then writes ``RUN_DIR/summary.json`` (``python -m arpo_async.launcher.slurm
summary``) and exits with the learner's status. A dead learner rank fails the job (srun
``--kill-on-bad-exit``); a dead actor is restarted by its ``launch actor`` wrapper
(``actors.max_restarts``). docs/design.md, "Beyond one machine", shows a script.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from arpo_async.core.config import Config, ConfigError, RemoteActorsConfig, load_config, save_config
from arpo_async.core.files import atomic_write_bytes
from arpo_async.core.host import is_loopback
from arpo_async.core.keys import generate, keys_dir
from arpo_async.launcher.plan import DEFAULT_MASTER_PORT
from arpo_async.launcher.supervisor import LaunchRequest, run_summary

SCRIPT_NAME = "slurm.sbatch"


@dataclass(frozen=True)
class Layout:
    """How the job spreads over nodes: learner nodes and ranks on each, actor nodes and
    actors on each, and the sbatch options both components share."""

    nodes_learner: int
    nodes_actors: int
    ranks_per_node: int
    actors_per_node: int
    partition: str = ""
    time: str = ""


def layout(cfg: Config, nodes_learner: int, nodes_actors: int, partition: str = "",
           time: str = "") -> Layout:
    """Check that the run divides over the nodes; ConfigError names the key."""
    if nodes_learner < 1 or nodes_actors < 1:
        raise ConfigError(f"--nodes-learner={nodes_learner} --nodes-actors={nodes_actors}: "
                          "each needs at least one node")
    world, actors = cfg.learner.world_size, cfg.actors.num
    if world % nodes_learner:
        raise ConfigError(f"learner.world_size={world} does not divide over "
                          f"--nodes-learner={nodes_learner} nodes")
    if actors < nodes_actors or actors % nodes_actors:
        raise ConfigError(f"actors.num={actors} (the job's actors, all on actor nodes) does "
                          f"not divide over --nodes-actors={nodes_actors} nodes")
    if cfg.cluster.hostfile or cfg.cluster.remote_actors:
        key = "hostfile" if cfg.cluster.hostfile else "remote_actors"
        raise ConfigError(f"cluster.{key} is set: under Slurm, Slurm places the learner and "
                          "the actors; leave it empty")
    return Layout(nodes_learner, nodes_actors, world // nodes_learner, actors // nodes_actors,
                  partition, time)


def check_ports(cfg: Config) -> None:
    for key in ("trajectory_port", "control_port"):
        if getattr(cfg.transport, key) == 0:
            raise ConfigError(f"transport.{key}=0: actors on other nodes connect to fixed "
                              "ports; set transport.trajectory_port and transport.control_port "
                              "(e.g. 29610 and 29611)")


def job_config(cfg: Config) -> Config:
    """The config every node of the job reads: no actor on the learner's nodes (the
    ``actors.num`` actors join as remote actors, ids 0..num-1), the learner bound to every
    interface unless ``transport.host`` names one."""
    out = cfg.model_copy(deep=True)
    if is_loopback(out.transport.host):
        out.transport.host = "0.0.0.0"
    total, out.actors.num = out.actors.num, 0
    out.cluster.remote_actors = [RemoteActorsConfig(host="slurm-het-group-1", actors=total)]
    return out


def slurm_request(args) -> LaunchRequest:
    """The run a Slurm job resolves: ``args``' config and overrides, the learner bound to
    ``0.0.0.0`` when ``transport.host`` is a loopback address, with the CurveZMQ keys
    created when missing (the entry point resolves and prepares it, as for any launch).
    The ports and the node layout are checked before anything is made."""
    cfg = load_config(args.config, args.overrides)
    check_ports(cfg)
    layout(cfg, args.nodes_learner, args.nodes_actors, args.partition, args.time)  # first
    bind = ["transport.host=0.0.0.0"] if is_loopback(cfg.transport.host) else []
    if not cfg.transport.insecure and not (keys_dir(cfg.run.dir) / "server.key_secret").exists():
        print(f"creating CurveZMQ keys in {generate(cfg.run.dir)}", flush=True)
    return LaunchRequest(config=args.config, overrides=[*args.overrides, *bind], quiet=True)


def _sbatch_lines(cfg: Config, lay: Layout, workdir: str) -> list[str]:
    cuda = cfg.cluster.device == "cuda"
    common = [f"--partition={lay.partition}"] if lay.partition else []
    common += [f"--time={lay.time}"] if lay.time else []
    learner = [f"--nodes={lay.nodes_learner}", "--ntasks-per-node=1",
               f"--cpus-per-task={cfg.learner.threads * lay.ranks_per_node}"]
    actors = [f"--nodes={lay.nodes_actors}", f"--ntasks-per-node={lay.actors_per_node}",
              f"--cpus-per-task={cfg.actors.threads}"]
    if cuda:
        learner.append(f"--gpus-per-node={lay.ranks_per_node}")
        actors.append(f"--gpus-per-node={lay.actors_per_node * cfg.actors.gpus_per_actor}")
    name = Path(cfg.run.dir).name or "run"
    out = [f"#SBATCH --job-name=arpo-{name}", f"#SBATCH --chdir={workdir}",
           f"#SBATCH --output={cfg.run.dir}/logs/slurm-%j.out"]
    out += [f"#SBATCH {o}" for o in common + learner]
    out += ["#SBATCH hetjob"] + [f"#SBATCH {o}" for o in common + actors]
    return out


def sbatch_script(cfg: Config, lay: Layout, python: str, workdir: str) -> str:
    """The job script (pure: the same config gives the same text)."""
    t, run = cfg.transport, shlex.quote(cfg.run.dir)
    config = shlex.quote(f"{cfg.run.dir}/config.yaml")
    port = cfg.cluster.master_port or DEFAULT_MASTER_PORT
    accel = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    gpu_step = (f" --gpus={cfg.actors.gpus_per_actor}" if accel == "cuda" else "")
    total = lay.nodes_actors * lay.actors_per_node
    body = f"""#!/bin/bash
# arpo_async on Slurm (python -m arpo_async.launch --slurm): the learner on het group 0,
# {total} actor(s) on het group 1; all read the run folder {run} (config, keys): shared.
{chr(10).join(_sbatch_lines(cfg, lay, workdir))}
set -u
PY={shlex.quote(python)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
learner_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)
learner_addr=$(scontrol show node "$learner_node" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
learner_addr=${{learner_addr:-$learner_node}}
echo "learner: nodes $SLURM_JOB_NODELIST_HET_GROUP_0, rank 0 on $learner_node ($learner_addr)"
# one torchrun per learner node; node 0 (rank 0: the sockets) is $learner_node
srun --het-group=0 --kill-on-bad-exit=1 \\
  env OMP_NUM_THREADS={cfg.learner.threads} DS_ACCELERATOR={accel} \\
  MASTER_ADDR="$learner_addr" bash -c 'exec "$0" -m torch.distributed.run \\
  --nnodes={lay.nodes_learner} --nproc-per-node={lay.ranks_per_node} \\
  --node-rank="$SLURM_NODEID" --master-addr="$MASTER_ADDR" --master-port={port} \\
  -m learner.main --config "$1"' "$PY" {config} \\
  > {run}/logs/learner.log 2>&1 &
learner=$!
actors=()
actor_id=0
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1"); do
  for _ in $(seq {lay.actors_per_node}); do
    echo "actor $actor_id: node $node"
    srun --het-group=1 --nodes=1 --ntasks=1 --exact --nodelist="$node"{gpu_step} \\
      env OMP_NUM_THREADS={cfg.actors.threads} \\
      "$PY" -m arpo_async.launch actor --connect "tcp://$learner_addr:{t.control_port}" \\
      --actor-id "$actor_id" --keys {run}/keys \\
      > {run}/logs/actor$actor_id.log 2>&1 &
    actors+=($!)
    actor_id=$((actor_id + 1))
  done
done
wait "$learner"
code=$?
# the learner has told the actors to stop; they say Bye and exit (actors.stop_wait_s)
deadline=$((SECONDS + {int(cfg.actors.stop_wait_s)}))
for pid in "${{actors[@]}}"; do
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done
  kill "$pid" 2>/dev/null
done
wait
"$PY" -m arpo_async.launcher.slurm summary --run-dir {run} --learner-exit "$code" \\
  --wall-s "$SECONDS"
exit "$code"
"""
    return body


def submit(script: Path) -> str:
    """``sbatch`` the script; the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found: run this on a Slurm login node, or write the "
                          "script with --emit FILE")
    res = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                         text=True, timeout=120)
    if res.returncode != 0:
        raise ConfigError(f"sbatch {script} failed: {(res.stderr or res.stdout).strip()}")
    return res.stdout.strip().split(";")[0]


def run_slurm(args, cfg: Config) -> int:
    """``launch --slurm``: ``cfg`` is ``slurm_request(args)`` resolved and prepared by the
    entry point; write RUN_DIR/config.yaml (``job_config``) and the script, submit it
    unless --emit."""
    lay = layout(cfg, args.nodes_learner, args.nodes_actors, args.partition, args.time)
    cfg = job_config(cfg)
    run_dir = Path(cfg.run.dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    script = Path(args.emit) if args.emit else run_dir / SCRIPT_NAME
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(sbatch_script(cfg, lay, sys.executable, str(Path.cwd())))
    print(f"wrote {script}: learner {lay.nodes_learner} node(s) x {lay.ranks_per_node} "
          f"rank(s), actors {lay.nodes_actors} node(s) x {lay.actors_per_node}", flush=True)
    if args.emit:
        print(f"submit it with: sbatch {script}", flush=True)
        return 0
    job = submit(script)
    print(f"submitted job {job}; its log: {run_dir}/logs/slurm-{job}.out", flush=True)
    return 0


# ----------------------------------------------------------------------------- in the job


def write_summary(run_dir: Path, learner_exit: int, wall_s: float) -> dict:
    """RUN_DIR/summary.json of a Slurm job, as the launcher writes it for its own runs."""
    cfg = load_config(run_dir / "config.yaml")
    status = "ok" if learner_exit == 0 else "failed"
    reason = "" if learner_exit == 0 else f"learner step exited with code {learner_exit}"
    summary = run_summary(cfg, [], status, reason, wall_s)
    atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=1).encode())
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arpo_async.launcher.slurm",
                                description="helpers the sbatch script runs")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="write RUN_DIR/summary.json after the learner ended")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--learner-exit", type=int, required=True)
    s.add_argument("--wall-s", type=float, default=0.0)
    args = p.parse_args(argv)
    summary = write_summary(Path(args.run_dir), args.learner_exit, args.wall_s)
    print(f"summary: status={summary['status']}, steps={summary['steps']}, "
          f"ledger={json.dumps(summary['ledger'], sort_keys=True)}", flush=True)
    for gone in summary["actors_not_back"]:
        print(f"actor {gone['actor']} ({gone['host']}) never came back", flush=True)
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
