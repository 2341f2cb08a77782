"""Process supervision for ``arpo_async.launch``: resolve the config, start the roles,
watch them, restart dead actors, stop everything cleanly, write the summary."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from arpo_async.config import Config, ConfigError, load_config, save_config


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "*") else "127.0.0.1", 0))
        return s.getsockname()[1]


def resolve(args) -> Config:
    """Load and fix everything that must be the same in every process."""
    if args.resume:
        path = Path(args.resume) / "config.yaml"
        if not path.is_file():
            raise ConfigError(f"--resume: {path} does not exist")
        cfg = load_config(path, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    if args.quiet:
        cfg.run.quiet = True
    if not args.dry_run:
        from arpo_async.tiny_model import ensure_model

        try:
            cfg.model.path = str(ensure_model(cfg.model.path, cfg.model))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
    t = cfg.transport
    if t.trajectory_port == 0:
        t.trajectory_port = _free_port(t.host)
    if t.control_port == 0:
        t.control_port = _free_port(t.host)
    return cfg


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
        if self.proc is None or self.proc.poll() is not None:
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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def plan(cfg: Config, config_path: Path) -> list[Role]:
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(cfg.learner.threads))
    logs = Path(cfg.run.dir) / "logs"
    w = cfg.learner.world_size
    if w == 1:
        learner_cmd = [py, "-m", "learner.main", "--config", str(config_path)]
    else:
        learner_cmd = [py, "-m", "torch.distributed.run", f"--nproc-per-node={w}",
                       f"--master-port={_free_port('127.0.0.1')}", "-m", "learner.main",
                       "--config", str(config_path)]
    roles = [Role("learner", learner_cmd, env, logs / "learner.log")]
    for i in range(cfg.actors.num):
        aenv = dict(env, OMP_NUM_THREADS=str(cfg.actors.threads))
        roles.append(Role(f"actor{i}", [py, "-m", "actors.main", "--config", str(config_path),
                                        "--actor-id", str(i)], aenv, logs / f"actor{i}.log"))
    return roles


def launch(args) -> int:
    cfg = resolve(args)
    run_dir = Path(cfg.run.dir)
    config_path = run_dir / "config.yaml"
    roles = plan(cfg, config_path)
    if args.dry_run:
        print(f"config OK; run folder {run_dir}")
        for r in roles:
            print(f"  {r.name:10s} on localhost: {' '.join(r.cmd)}")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, config_path)
    from arpo_async.dsops import prebuild_deepspeed_ops

    prebuild_deepspeed_ops()
    from arpo_async.progress import Progress

    progress = Progress(cfg)
    t0 = time.time()
    for r in roles:
        r.start()
    _write_processes(run_dir, roles)
    status, reason = "ok", ""
    try:
        status, reason = _watch(cfg, roles, progress, run_dir)
    except KeyboardInterrupt:
        status, reason = "interrupted", "Ctrl-C"
    finally:
        progress.close()
        for r in reversed(roles):  # actors first, learner last
            r.stop()
    summary = _summary(cfg, roles, status, reason, time.time() - t0)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    progress.final(summary)
    if status != "ok":
        print(f"run failed: {reason}", file=sys.stderr)
        return 130 if status == "interrupted" else 1
    return 0


def _watch(cfg: Config, roles: list[Role], progress, run_dir: Path) -> tuple[str, str]:
    learner, actors = roles[0], roles[1:]
    learner_done_at = None
    while True:
        time.sleep(0.5)
        progress.update()
        code = learner.proc.poll()
        if code is not None and code != 0:
            return "failed", f"learner exited with code {code}:\n{learner.tail()}"
        if code == 0 and learner_done_at is None:
            learner_done_at = time.time()
        for a in actors:
            ac = a.proc.poll()
            # exit code 0: the learner told the actor to stop; nothing to restart
            if ac is None or ac == 0 or learner_done_at is not None:
                continue
            a.history.append({"event": "exit", "code": ac, "time": time.time()})
            if a.restarts >= cfg.actors.max_restarts:
                return "failed", (f"{a.name} exited with code {ac} after {a.restarts} restarts:"
                                  f"\n{a.tail()}")
            a.restarts += 1
            time.sleep(min(2.0 ** a.restarts, 30.0))  # backoff
            progress.note(f"{a.name} exited with code {ac}; restart {a.restarts}")
            a.start()
            _write_processes(run_dir, roles)
        if learner_done_at is not None:
            if all(a.proc.poll() is not None for a in actors):
                return "ok", ""
            if time.time() - learner_done_at > cfg.transport.timeout_s:
                return "ok", ""  # stragglers are stopped by the caller


def _write_processes(run_dir: Path, roles: list[Role]) -> None:
    data = {r.name: r.proc.pid for r in roles if r.proc is not None}
    tmp = run_dir / "processes.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(run_dir / "processes.json")


def _summary(cfg: Config, roles: list[Role], status: str, reason: str, wall: float) -> dict:
    from arpo_async.metrics import read_metrics

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
        "ledger": learner.get("ledger", {}), "learner": learner.get("service", {}),
    }


def _mean(values) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None
