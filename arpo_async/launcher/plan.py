"""The process plan: which roles run, how many, on which machines and devices, with which
commands and environment.

Pure: it reads the config (and the DeepSpeed hostfile the config names) and starts
nothing, so GPU and multi-machine configs can be checked on a laptop
(``python -m arpo_async.launch --config F --dry-run`` prints it). The launcher turns the
local roles into processes; remote roles are printed as the commands to run on their
machines (``python -m arpo_async.launch actor --connect tcp://HOST:PORT``, see
arpo_async/launcher/remote.py and docs/scale-out.md).

Layout rules, checked here with errors that name the key:
- the learner runs ``learner.world_size`` ranks: one process on this machine, torchrun
  for several local ranks, or DeepSpeed's multi-node launcher over ``cluster.hostfile``;
- actor ids are 0..actors.num-1 for local actors, then the remote groups in order;
- on GPUs every actor takes ``actors.engine.tensor_parallel`` consecutive ids of its list;
- NCCL weight sync cannot put two ranks on one GPU, so a local actor may not share the
  learner's first GPU then.
"""

from __future__ import annotations

import re
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from arpo_async.core.config import Config, ConfigError, total_actors
from arpo_async.core.config.actors import engines_that
from arpo_async.core.host import is_loopback

_WILDCARDS = ("0.0.0.0", "*", "::", "")
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's own grammar
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class RoleSpec:
    """One process of the run. ``env`` holds only what the plan sets; the launcher adds
    it to its own environment."""

    name: str  # "learner", "actor0", ...
    kind: str  # "learner" or "actor"
    host: str  # "localhost" or the machine a remote role runs on
    devices: str  # "cpu", "cuda:4,5", or "hostfile hostA:0-3 hostB:0-3"
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    local: bool = True  # False: started by hand on ``host``
    actor_id: int = -1
    weights: str = ""  # actors: the weight channel, "zmq" or "nccl"
    log: str = ""  # file name under RUN_DIR/logs

    def command(self) -> str:
        """One shell line: the environment, then the command."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


# ----------------------------------------------------------------------------- learner


def parse_hostfile(text: str, where: str) -> dict[str, int]:
    """``HOST slots=N`` lines (``#`` comments) -> {host: slots}, as DeepSpeed reads them."""
    hosts: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOSTFILE_LINE.match(line)
        if not m:
            raise ConfigError(f"{where}:{lineno}: expected 'HOST slots=N', got {line!r}")
        if m.group(1) in hosts:
            raise ConfigError(f"{where}:{lineno}: host {m.group(1)} listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise ConfigError(f"{where}: no 'HOST slots=N' line")
    return hosts


def learner_hosts(cfg: Config) -> dict[str, list[int]]:
    """Learner machines -> the slot (GPU) ids its ranks use there; checks the world size."""
    cl, world = cfg.cluster, cfg.learner.world_size
    if len(set(cl.learner_gpus)) != len(cl.learner_gpus):
        raise ConfigError(f"cluster.learner_gpus: duplicate ids in {cl.learner_gpus}")
    if cl.hostfile:
        path = Path(cl.hostfile)
        if not path.is_file():
            raise ConfigError(f"cluster.hostfile: {path} does not exist")
        slots = parse_hostfile(path.read_text(), str(path))
        hosts = {}
        for host, n in slots.items():
            ids = list(cl.learner_gpus) or list(range(n))
            if max(ids) >= n:
                raise ConfigError(f"cluster.learner_gpus: id {max(ids)} but {path} gives "
                                  f"{host} only {n} slots")
            hosts[host] = ids
        where = f"{len(hosts)} hosts of {path}"
    else:
        hosts = {"localhost": list(cl.learner_gpus) or list(range(world))}
        where = "cluster.learner_gpus" if cl.learner_gpus else "learner.world_size"
    ranks = sum(len(ids) for ids in hosts.values())
    if ranks != world:
        raise ConfigError(f"learner.world_size={world} but {where} give {ranks} learner ranks")
    return hosts


def _learner_role(cfg: Config, config_path: str, master_port: int, python: str) -> RoleSpec:
    cl, world = cfg.cluster, cfg.learner.world_size
    cuda = cl.device == "cuda"
    hosts = learner_hosts(cfg)
    env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(cfg.learner.threads),
           "DS_ACCELERATOR": "cuda" if cuda else "cpu"}
    main = ["learner.main", "--config", config_path]
    if cl.hostfile:
        addr = cl.master_addr or next(iter(hosts))
        argv = [python, "-m", "deepspeed.launcher.runner", "--hostfile", cl.hostfile]
        if cuda:  # DeepSpeed sets CUDA_VISIBLE_DEVICES on each node from this filter
            argv += ["--include", "@".join(f"{h}:{','.join(map(str, ids))}"
                                           for h, ids in hosts.items())]
        argv += ["--master_addr", addr, "--master_port", str(master_port), "--module",
                 "--no_local_rank", *main]
        devices = "hostfile " + " ".join(f"{h}:{_ids(ids)}" for h, ids in hosts.items())
    else:
        if world == 1:
            argv = [python, "-m", *main]
        else:
            argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                    f"--master-addr={cl.master_addr or '127.0.0.1'}",
                    f"--master-port={master_port}", "-m", *main]
        gpus = hosts["localhost"]
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        devices = f"cuda:{_ids(gpus)}" if cuda else f"cpu x{world}"
    return RoleSpec("learner", "learner", "localhost", devices, tuple(argv), env,
                    log="learner.log")


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


# ----------------------------------------------------------------------------- actors


def actor_gpu_slices(gpus: list[int], n: int, tp: int, where: str) -> list[list[int]]:
    """``n`` actors of ``tp`` GPUs each from ``gpus``, in order."""
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"{where}: duplicate GPU ids in {gpus}")
    if len(gpus) < n * tp:
        raise ConfigError(f"{where}: {n} actors x actors.engine.tensor_parallel={tp} need {n * tp} "
                          f"GPU ids, got {len(gpus)} ({gpus})")
    return [gpus[i * tp:(i + 1) * tp] for i in range(n)]


def connect_address(cfg: Config) -> str:
    """The address actors on other machines use to reach the learner's rank 0."""
    cl, host = cfg.cluster, cfg.transport.host
    if cl.learner_address:
        return cl.learner_address
    if host not in _WILDCARDS:
        return host
    if cl.hostfile and Path(cl.hostfile).is_file():
        return next(iter(parse_hostfile(Path(cl.hostfile).read_text(), cl.hostfile)))
    return socket.gethostname()


def _keys_dir(cfg: Config) -> str | None:
    """The keys folder remote actors need, or None when the learner runs without keys."""
    keys = Path(cfg.run.dir) / "keys"
    needed = not is_loopback(cfg.transport.host) and not cfg.transport.insecure
    return str(keys) if needed or (keys / "server.key_secret").exists() else None


def _actor_roles(cfg: Config, config_path: str, python: str) -> list[RoleSpec]:
    cl, tp = cfg.cluster, cfg.actors.gpus_per_actor
    cuda = cl.device == "cuda"
    nccl = cfg.learner.weight_sync.channel == "nccl"  # with a hostfile: if this is rank 0's machine
    base = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(cfg.actors.threads)}
    n = cfg.actors.num
    eng = cfg.actors.engine
    per = eng.actors_per_process if eng.shares_process else 1
    if per > 1:  # e.g. simulated actors share processes (actors/engines/sim_engine.py); no GPU
        roles = []
        for first in range(0, n, per):
            ids = f"{first}-{min(first + per, n) - 1}"
            roles.append(RoleSpec(
                f"actors{ids}", "actor", "localhost", "cpu",
                (python, "-m", "actors.main", "--config", config_path, "--actor-ids", ids),
                dict(base), actor_id=first, weights="zmq", log=f"actors{ids}.log"))
        return roles + _remote_roles(cfg)
    slices = actor_gpu_slices(cl.actor_gpus, n, tp, "cluster.actor_gpus") if cuda else [[]] * n
    roles = []
    for i, gpus in enumerate(slices):
        env = dict(base, CUDA_VISIBLE_DEVICES=_ids(gpus)) if cuda else dict(base)
        roles.append(RoleSpec(
            f"actor{i}", "actor", "localhost", f"cuda:{_ids(gpus)}" if cuda else "cpu",
            (python, "-m", "actors.main", "--config", config_path, "--actor-id", str(i)),
            env, actor_id=i, weights="nccl" if nccl else "zmq", log=f"actor{i}.log"))
    return roles + _remote_roles(cfg)


def _remote_roles(cfg: Config) -> list[RoleSpec]:
    """Actors started by hand on other machines, ids after the local ones."""
    cl, tp, cuda = cfg.cluster, cfg.actors.gpus_per_actor, cfg.cluster.device == "cuda"
    endpoint = f"tcp://{connect_address(cfg)}:{cfg.transport.control_port}"
    keys = _keys_dir(cfg)
    roles, next_id = [], cfg.actors.num
    for k, group in enumerate(cl.remote_actors):
        where = f"cluster.remote_actors.{k}.gpus"
        gpu_slices = (actor_gpu_slices(group.gpus, group.actors, tp, where) if cuda
                      else [[]] * group.actors)
        for gpus in gpu_slices:
            argv = ["python", "-m", "arpo_async.launch", "actor", "--connect", endpoint,
                    "--actor-id", str(next_id)] + (["--keys", keys] if keys else [])
            env = {"CUDA_VISIBLE_DEVICES": _ids(gpus)} if cuda else {}
            roles.append(RoleSpec(
                f"actor{next_id}", "actor", group.host,
                f"cuda:{_ids(gpus)}" if cuda else "cpu", tuple(argv), env, local=False,
                actor_id=next_id, weights="zmq", log=f"actor{next_id}.log"))
            next_id += 1
    return roles


# ----------------------------------------------------------------------------- checks


def check_placement(cfg: Config) -> list[str]:
    """Raise ConfigError for a layout that cannot run; return notes worth reading."""
    cl, t, notes = cfg.cluster, cfg.transport, []
    if cl.device == "cpu":
        for key in ("learner_gpus", "actor_gpus"):
            if getattr(cl, key):
                raise ConfigError(f"cluster.{key} is set but cluster.device=cpu")
        if any(r.gpus for r in cl.remote_actors):
            raise ConfigError("cluster.remote_actors[].gpus is set but cluster.device=cpu")
    eng = cfg.actors.engine
    if cfg.learner.weight_sync.channel == "nccl" and not eng.native_weight_transfer:
        raise ConfigError("learner.weight_sync.channel=nccl needs actors.engine="
                          f"{' or '.join(engines_that('native_weight_transfer'))} "
                          f"(got {eng.type})")
    remote_hosts = [r.host for r in cl.remote_actors]
    if cl.hostfile:
        remote_hosts += list(learner_hosts(cfg))
    if is_loopback(t.host) and any(not is_loopback(h) and h != "localhost"
                                   for h in remote_hosts):
        raise ConfigError(f"transport.host={t.host} is a loopback address: actors on "
                          f"{remote_hosts[0]} cannot reach the learner; bind 0.0.0.0 or this "
                          "machine's address")
    learner = learner_hosts(cfg)
    if cl.device == "cuda":
        notes += _gpu_notes(cfg, learner)
    if cfg.learner.weight_sync.channel == "nccl":
        notes.append("weights: NCCL to vLLM actors on the learner's machine, ZeroMQ to the "
                     "others (decided at run time by machine identity)")
    if not is_loopback(t.host) and not t.insecure:
        notes.append(f"transport.host={t.host} is not loopback: create CurveZMQ keys before "
                     f"launching (python -m arpo_async.core.keys {cfg.run.dir}) and copy "
                     "keys/client.key_secret and keys/server.key to every actor machine")
    if cl.remote_actors:
        notes.append("start the remote actors after the learner; the learner waits "
                     f"actors.start_wait_s={cfg.actors.start_wait_s:g} s for all "
                     f"{total_actors(cfg)} actors before the first ticket")
    if cl.hostfile:
        first = next(iter(learner))
        notes.append(f"run the launcher on {first}, the first hostfile host: learner rank 0 "
                     "and the local actors run there")
        notes.append("every learner machine needs this repository, the Python environment "
                     f"and {cfg.run.dir} at the same paths (a shared filesystem), and "
                     "passwordless ssh from here (DeepSpeed's pdsh launcher)")
    return notes


def _gpu_notes(cfg: Config, learner: dict[str, list[int]]) -> list[str]:
    """cluster.device=cuda: local actors share a machine with rank 0. Raise ConfigError
    for a GPU NCCL would need twice; say what the engine makes of the GPUs."""
    eng, notes = cfg.actors.engine, []
    shared = sorted(set(next(iter(learner.values()))) & set(cfg.cluster.actor_gpus))
    if shared and cfg.learner.weight_sync.channel == "nccl":
        raise ConfigError(f"learner.weight_sync.channel=nccl: GPU {shared[0]} is used by the "
                          "learner and a local actor, and NCCL cannot connect two ranks "
                          "on one GPU; give the actors other cluster.actor_gpus or use "
                          "learner.weight_sync.channel=zmq")
    if shared and eng.uses_gpu:
        notes.append(f"GPUs {shared} are shared by the learner and local actors: the "
                     f"{eng.type} engine takes actors.engine.gpu_memory_utilization="
                     f"{eng.gpu_memory_utilization} of each; leave the learner the rest")
    if not eng.uses_gpu:
        notes.append(f"actors.engine={eng.type} does not use the GPU (only the "
                     f"{'/'.join(engines_that('uses_gpu'))} engine does); its actors compute "
                     "on the CPU")
    return notes


def _path_notes(cfg: Config) -> list[str]:
    notes = []
    model = cfg.model.path
    if not Path(model).is_dir():
        notes.append(f"model.path={model} is not a folder here: " + (
            "the launcher builds the tiny local model there" if cfg.model.build_if_missing
            else "transformers and vLLM load it from the Hugging Face cache"))
    if cfg.task.name == "file" and not Path(cfg.task.data).is_file():
        notes.append(f"task.data={cfg.task.data} does not exist here; it must exist where "
                     "the actors run")
    if "search" in cfg.tools.enabled:
        url = cfg.tools.search.retriever_url or "(no tools.search.retriever_url)"
        notes.append(f"tools: search calls {url}; start a retriever there first (python -m "
                     "toolenv serve-retriever, or your own)")
    return notes


# ----------------------------------------------------------------------------- plan


def plan(cfg: Config, config_path: str | Path, master_port: int = DEFAULT_MASTER_PORT,
         python: str = sys.executable) -> list[RoleSpec]:
    """Every role of the run, learner first; raises ConfigError on a bad layout."""
    check_placement(cfg)
    config_path = str(config_path)
    return [_learner_role(cfg, config_path, master_port, python),
            *_actor_roles(cfg, config_path, python)]


def format_plan(cfg: Config, roles: list[RoleSpec], notes: list[str]) -> str:
    """The plan as text: a summary, one block per role, then the notes."""
    cl = cfg.cluster
    local = [r for r in roles if r.local and r.kind == "actor"]
    remote = [r for r in roles if not r.local]
    out = [f"run folder {cfg.run.dir}; device {cl.device}; model {cfg.model.path}",
           f"learner: {cfg.learner.world_size} rank(s), ZeRO-{cfg.learner.zero_stage}; "
           f"actors: {len(local)} local + {len(remote)} remote, engine {cfg.actors.engine.type}, "
           f"tensor parallel {cfg.actors.gpus_per_actor}",
           f"learner binds {cfg.transport.host}: trajectories port "
           f"{cfg.transport.trajectory_port or 'auto'}, control port "
           f"{cfg.transport.control_port or 'auto'}"
           + (f"; remote actors connect to {connect_address(cfg)}" if remote else ""), ""]
    for r in roles:
        where = "started here" if r.local else f"start on {r.host}"
        extra = f", weights {r.weights}" if r.weights else ""
        out.append(f"{r.name} ({where}; {r.devices}{extra})")
        out.append(f"  {r.command()}")
    if notes:
        out += ["", "notes:"] + [f"  - {n}" for n in notes]
    return "\n".join(out)


def dry_run(cfg: Config, source: str) -> int:
    """``launch --dry-run``: print the plan of ``cfg`` (read from ``source``, checked and
    prepared by the entry point in its dry-run form: nothing is built), start nothing."""
    port = cfg.cluster.master_port or DEFAULT_MASTER_PORT
    roles = plan(cfg, Path(cfg.run.dir) / "config.yaml", master_port=port)
    notes = check_placement(cfg) + _path_notes(cfg)
    if not cfg.cluster.master_port and cfg.learner.world_size > 1:
        notes.append(f"the rendezvous port {port} is an example: a free one is chosen at "
                     "launch (set cluster.master_port to fix it)")
    print(f"config OK: {source}")
    print(format_plan(cfg, roles, notes))
    return 0
