"""Process supervision for ``arpo_async.launch``: load and check the config (``resolve``),
start the roles, watch them, restart what died, stop everything cleanly, write the
summary. The launcher imports only the core: what needs the model or the tool classes
(the model folder, built when missing; prompt lengths; custom tools) is prepared by the
entry point (arpo_async/jobs/preflight.py ``resolve_run``) before ``launch`` gets the
config, which it writes once to RUN_DIR/config.yaml, the file every role reads.

The roles are those of arpo_async/launcher/plan.py, the plan ``--dry-run`` prints: the launcher
starts the local ones and prints the commands of the remote actors (started by hand on
their machines, docs/scale-out.md).

Faults: a dead actor is restarted after a backoff (``actors.restart_backoff_s``,
doubling, at most 30 s) while the learner keeps training with the others; after
``actors.max_restarts`` restarts it is given up (the run goes on while any actor is
left). A dead learner is restarted with ``--resume`` from its newest checkpoint up to
``learner.max_restarts`` times; the running actors reconnect by themselves.
``--resume RUN_DIR`` (the launcher itself died) adopts the actors of RUN_DIR that are
still running and starts the rest. Every exit, restart and adoption is a line in
``RUN_DIR/events.jsonl``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from arpo_async.core.config import Config, ConfigError, load_config, save_config
from arpo_async.core.dsops import prebuild_deepspeed_ops
from arpo_async.core.files import atomic_write_bytes, atomic_write_json, read_json
from arpo_async.core.host import is_loopback
from arpo_async.core.keys import SecurityError, keys_dir, require_security
from arpo_async.core.ports import free_port
from arpo_async.core.metrics import append_jsonl, read_metrics, variance_summary
from arpo_async.core.rundir import exit_record, latest_checkpoint, recorded_exit
from arpo_async.launcher.plan import RoleSpec
from arpo_async.launcher.plan import plan as process_plan
from arpo_async.launcher.progress import Progress


@dataclass
class LaunchRequest:
    """What to launch: the arguments of ``python -m arpo_async.launch``, or the pipeline's
    RL stage."""

    config: str | None = None  # YAML config (None: configs/default.yaml)
    overrides: list[str] = field(default_factory=list)  # dotted key=value pairs
    resume: str | None = None  # RUN_DIR to continue
    quiet: bool = False  # plain log lines, no live panel
    dry_run: bool = False  # validate only: no model is built, nothing starts


def load(args: LaunchRequest) -> Config:
    """The config a request names: RUN_DIR/config.yaml on ``--resume``, else its file (or
    configs/default.yaml), with its overrides."""
    if args.resume:
        path = Path(args.resume) / "config.yaml"
        if not path.is_file():
            raise ConfigError(f"--resume: {path} does not exist")
        return load_config(path, args.overrides)
    return load_config(args.config, args.overrides)


def resolve(args: LaunchRequest) -> Config:
    """``with_ports(checked(load(args)))``."""
    return with_ports(checked(load(args)))


def checked(cfg: Config) -> Config:
    """What the launcher checks before anything is built: the rules a run must meet
    (``check_trainable``) and CurveZMQ for a non-loopback bind."""
    cfg.check_trainable()
    _check_security(cfg)
    return cfg


def with_ports(cfg: Config) -> Config:
    """The ports, chosen here when 0 (so that every process reads the same), as late as
    possible before the roles bind them."""
    t = cfg.transport
    if t.trajectory_port == 0:
        t.trajectory_port = free_port(t.host)
    if t.control_port == 0:
        t.control_port = free_port(t.host)
    return cfg


def _check_security(cfg: Config) -> None:
    """A non-loopback bind needs CurveZMQ keys in RUN_DIR/keys, or transport.insecure
    (then a warning says what is exposed)."""
    host = cfg.transport.host
    try:
        keys = require_security(host, cfg.transport.insecure, keys_dir(cfg.run.dir))
    except SecurityError as exc:
        raise ConfigError(str(exc)) from None
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"CurveZMQ keys: {exc}") from None
    if keys is None and not is_loopback(host):
        print(f"WARNING: binding {host} WITHOUT encryption or authentication "
              "(transport.insecure=true): anyone who can reach the ports can send trajectories "
              "and fetch weights", file=sys.stderr, flush=True)


@dataclass
class Role:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    history: list[dict] = field(default_factory=list)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("ab")
        # own session: Ctrl-C reaches only the launcher, which stops children in order
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.history.append({"event": "start", "pid": self.proc.pid, "time": time.time()})

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:  # what it left in its group (vLLM's engine)
            if isinstance(self.proc, subprocess.Popen):
                _signal_group(self.proc, signal.SIGKILL)
            return
        _signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(5)

    def tail(self, n: int = 12) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class _Adopted:
    """A role process an earlier launcher started (``--resume``), watched by pid like a
    Popen. Its exit status cannot be waited for (it is not our child): the code the role
    recorded in ``RUN_DIR/exits/PID.json`` (arpo_async/core/rundir.py), else -1."""

    def __init__(self, pid: int, code: Callable[[], int | None] = lambda: None):
        self.pid, self.returncode, self.code = pid, None, code

    def poll(self) -> int | None:
        if self.returncode is None and not _alive(self.pid):
            code = self.code()
            self.returncode = -1 if code is None else code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.1)
        return self.returncode


def _alive(pid: int) -> bool:
    """Running (a zombie, whose parent died and was not reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _adopt(roles: list[Role], run_dir: Path, events: Events) -> None:
    """--resume: take over the roles of processes.json that still run the same command."""
    pids = read_json(run_dir / "processes.json") or {}
    for role in roles:
        pid = pids.get(role.name)
        if not isinstance(pid, int) or not _alive(pid):
            continue
        if role.name == "learner":
            if "learner.main" in _cmdline(pid):
                raise ConfigError(f"--resume: the learner of {run_dir} is still running (pid "
                                  f"{pid}); stop it first (kill it) or let it finish")
            continue
        if _cmdline(pid)[1:] != role.cmd[1:]:  # the pid now belongs to something else
            continue
        exit_record(run_dir, pid).unlink(missing_ok=True)  # a record of an older process
        role.proc = _Adopted(pid, code=lambda p=pid: recorded_exit(run_dir, p))
        role.history.append({"event": "adopt", "pid": pid, "time": time.time()})
        events.log("adopt", role.name, pid=pid)


class Events:
    """RUN_DIR/events.jsonl: one line per start, exit, restart, give-up or adoption."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "events.jsonl"

    def log(self, event: str, role: str, **fields) -> None:
        append_jsonl(self.path, {"time": time.time(), "event": event, "role": role, **fields})


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def to_roles(cfg: Config, specs: list[RoleSpec]) -> list[Role]:
    """The local roles of a process plan as processes to start (the remote ones are
    started by hand on their machines)."""
    logs = Path(cfg.run.dir) / "logs"
    return [Role(s.name, list(s.argv), dict(os.environ, **s.env), logs / s.log)
            for s in specs if s.local]


def plan(cfg: Config, config_path: Path, resume: bool = False
         ) -> tuple[list[Role], list[RoleSpec]]:
    """What ``launch`` starts and what it leaves to other machines: arpo_async/launcher/plan.py's
    roles, the local ones as processes (learner first) and the remote ones as specs whose
    commands are printed, so a real run starts exactly what ``--dry-run`` prints (with a
    free rendezvous port when ``cluster.master_port`` is 0). ``resume``: the learner
    continues from its newest checkpoint."""
    specs = process_plan(cfg, config_path, master_port=_master_port(cfg))
    roles = to_roles(cfg, specs)
    if resume:
        roles[0].cmd = _with_resume(roles[0].cmd, cfg.cluster.master_port)
    return roles, [s for s in specs if not s.local]


def _master_port(cfg: Config) -> int:
    return cfg.cluster.master_port or free_port("127.0.0.1")


def _print_remote(remote: list[RoleSpec]) -> None:
    """The commands of the actors the user starts on other machines."""
    if not remote:
        return
    print(f"start these {len(remote)} actor(s) on their machines (after the learner is up):",
          flush=True)
    for s in remote:
        print(f"  {s.name} on {s.host} ({s.devices}): {s.command()}", flush=True)


class Terminated(Exception):
    """The launcher got SIGTERM or SIGHUP."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def launch(cfg: Config, args: LaunchRequest) -> int:
    """Run ``cfg``, resolved (``checked``) and prepared by the entry point; ``args`` says
    whether it resumes and how progress is shown."""
    run_dir = Path(cfg.run.dir)
    config_path = run_dir / "config.yaml"
    roles, remote = plan(cfg, config_path, resume=bool(args.resume))
    run_dir.mkdir(parents=True, exist_ok=True)
    events = Events(run_dir)
    if args.resume:
        _adopt(roles, run_dir, events)
    save_config(cfg, config_path)
    if cfg.cluster.device == "cpu":  # GPU learners use DeepSpeed's CUDA ops instead
        prebuild_deepspeed_ops()
    _print_remote(remote)
    progress = Progress(cfg, quiet=args.quiet)
    t0 = time.time()
    for r in roles:
        if r.proc is None:
            r.start()
            events.log("start", r.name, pid=r.proc.pid)
    _write_processes(run_dir, roles)
    status, reason = "ok", ""
    # The roles run in their own sessions (a terminal's Ctrl-C reaches only the launcher):
    # SIGTERM and SIGHUP must unwind like Ctrl-C, else they would outlive the launcher.
    previous = {sig: signal.signal(sig, _raise_terminated)
                for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        status, reason = _watch(cfg, roles, progress, run_dir, events)
    except KeyboardInterrupt:
        status, reason = "interrupted", "Ctrl-C"
    except Terminated as e:
        status, reason = "interrupted", str(e)
    finally:
        for sig in previous:  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        progress.close()
        for r in reversed(roles):  # actors first, learner last
            r.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = run_summary(cfg, roles, status, reason, time.time() - t0)
    atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=1).encode())
    progress.final(summary)
    if status != "ok":
        print(f"run failed: {reason}", file=sys.stderr)
        return 130 if status == "interrupted" else 1
    return 0


def _with_resume(cmd: list[str], fixed_port: int = 0) -> list[str]:
    """The learner command that continues from the newest checkpoint, with a fresh
    rendezvous port (the dead one's may linger in TIME_WAIT) unless ``cluster.master_port``
    fixed it (``fixed_port``): torchrun's ``--master-port=P`` or DeepSpeed's
    ``--master_port P``."""
    port = str(fixed_port or free_port("127.0.0.1"))
    out = []
    for i, c in enumerate(cmd):
        if c.startswith("--master-port="):
            c = f"--master-port={port}"
        elif i > 0 and cmd[i - 1] == "--master_port":
            c = port
        out.append(c)
    return out if "--resume" in out else out + ["--resume"]


def _backoff(base_s: float, restarts: int) -> float:
    return min(base_s * 2.0 ** max(restarts - 1, 0), 30.0)


def _watch(cfg: Config, roles: list[Role], progress, run_dir: Path,
           events: Events) -> tuple[str, str]:
    learner, actors = roles[0], roles[1:]
    learner_done_at = None
    due: dict[str, float] = {}  # role name -> when to restart it
    gave_up: list[str] = []
    while True:
        time.sleep(0.5)
        progress.update()
        now = time.time()
        code = learner.proc.poll()
        if code == 0 and learner_done_at is None:
            learner_done_at = now
        elif code is not None and code != 0 and learner.name not in due:
            events.log("exit", learner.name, pid=learner.proc.pid, code=code)
            if learner.restarts >= cfg.learner.max_restarts:
                return "failed", (f"learner exited with code {code} after {learner.restarts} "
                                  f"restarts:\n{learner.tail()}")
            learner.restarts += 1
            _signal_group(learner.proc, signal.SIGKILL)  # torchrun ranks left behind
            learner.cmd = _with_resume(learner.cmd, cfg.cluster.master_port)
            due[learner.name] = now + _backoff(cfg.learner.restart_backoff_s, learner.restarts)
            ckpt = latest_checkpoint(run_dir)
            progress.note(f"learner exited with code {code}; restart {learner.restarts} "
                          + (f"resumes from {ckpt.name}" if ckpt else
                             "starts from step 0 (no checkpoint; see learner.checkpoint_every)"))
        for a in actors:
            ac = a.proc.poll()
            # exit code 0: the learner told the actor to stop; nothing to restart
            if ac is None or ac == 0 or learner_done_at is not None or a.name in due \
                    or a.name in gave_up:
                continue
            a.history.append({"event": "exit", "code": ac, "time": now})
            events.log("exit", a.name, pid=a.proc.pid, code=ac)
            # an actor killed outright (SIGKILL, the OOM killer) leaves its vLLM engine
            # processes running in its group, each holding its model and KV cache
            _signal_group(a.proc, signal.SIGKILL)
            if a.restarts >= cfg.actors.max_restarts:
                gave_up.append(a.name)
                why = f"{a.name} exited with code {ac} after {a.restarts} restarts; giving up on it"
                events.log("give_up", a.name, reason=why)
                progress.note(why)
                if len(gave_up) == len(actors):
                    return "failed", f"every actor was given up; last: {why}:\n{a.tail()}"
                continue
            a.restarts += 1
            due[a.name] = now + _backoff(cfg.actors.restart_backoff_s, a.restarts)
            progress.note(f"{a.name} exited with code {ac}; restart {a.restarts} in "
                          f"{due[a.name] - now:.0f} s")
        for r in roles:
            if r.name in due and now >= due[r.name]:
                del due[r.name]
                r.start()
                events.log("restart", r.name, pid=r.proc.pid, restart=r.restarts)
                _write_processes(run_dir, roles)
        if learner_done_at is not None:
            if all(a.proc.poll() is not None for a in actors):
                return "ok", ""
            if time.time() - learner_done_at > cfg.actors.stop_wait_s:
                return "ok", ""  # stragglers are stopped by the caller


def _write_processes(run_dir: Path, roles: list[Role]) -> None:
    atomic_write_json(run_dir / "processes.json",
                      {r.name: r.proc.pid for r in roles if r.proc is not None})


def run_summary(cfg: Config, roles: list[Role], status: str, reason: str, wall: float) -> dict:
    """RUN_DIR/summary.json's content, from the learner's summary and metrics (also for
    runs placed by Slurm, arpo_async/launcher/slurm.py, with ``roles`` empty)."""
    run_dir = Path(cfg.run.dir)
    rows = read_metrics(run_dir)
    learner = {}
    path = run_dir / "learner_summary.json"
    if path.exists():
        learner = json.loads(path.read_text())
    last = rows[-1] if rows else {}
    return {
        "status": status, "reason": reason, "wall_time_s": wall,
        "steps": last.get("step", 0), "policy_version": last.get("policy_version", 0),
        "reward_mean_last": last.get("reward_mean"),
        "step_time_s_mean": _mean(r.get("step_time_s") for r in rows),
        "broadcast_time_s_mean": _mean(r.get("broadcast_time_s") for r in rows),
        "restarts": {r.name: r.restarts for r in roles},
        "adopted": [r.name for r in roles if any(h["event"] == "adopt" for h in r.history)],
        "ledger": learner.get("ledger", {}), "learner": learner.get("service", {}),
        # per prompt over all actors (learner/ledger.py PromptRecord)
        "prompts": prompt_totals(learner.get("ledger", {})),
        # model tokens received, trained, dropped by reason; KS of trained vs received
        # group lengths (learner/tokens.py)
        "tokens": learner.get("service", {}).get("tokens", {}),
        # actors that never said Bye, e.g. on a host that vanished (learner/ledger.py)
        "actors_not_back": learner.get("actors_not_back", []),
        # trained groups whose leaves' rewards differ: the only ones that teach anything
        "nonzero_var": variance_summary(rows),
    }


def prompt_totals(ledger: dict) -> dict:
    """Prompts taken, duplicates dropped and skipped, summed over the ledger's actors."""
    return {k: sum(led.get("prompts", {}).get(k, 0) for led in ledger.values())
            for k in ("taken", "duplicates", "skipped")}


def _mean(values) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None
