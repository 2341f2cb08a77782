"""The chaos soak: a real training run under continual, seeded random faults,
then a verdict from the run's own records.

``python -m arpo_async.jobs.experiments chaos [--duration-s 1800] [--fault-every-s 45]
[--seed 0] [--faults actor_kill,...] [--sft-steps 300] [--startup-s 60] [--grace-s 900]
[--config F] [key=value ...]``

The run is the default job's RL stage (configs/default.yaml with ``pipeline.enabled``
off): real vLLM actors, the DeepSpeed learner, the sandboxed Python tool and the BM25
retriever over the synthetic suite's corpus, from the tiny model after ``--sft-steps``
of cold-start SFT (so that it calls tools; 0: the untrained tiny model). The soak
starts the retriever itself, on a fixed port behind a delaying proxy (``tools.
search.retriever_url`` points at the proxy), and the launcher in its own session. From the
first learner step for ``--duration-s`` (``run.time_limit_s``, learner time, is that
plus ``--startup-s``: the learner's clock starts before the actors are up) it
injects a fault every ``--fault-every-s`` on average (uniform 0.5x-1.5x), of a kind drawn
from ``--faults`` with ``random.Random(--seed)`` (a kind with no target, e.g. no sandbox
alive, is drawn again):

- ``actor_kill``: SIGKILL of an actor's process group (the launcher restarts it);
- ``actor_stop``: SIGSTOP of an actor for ``learner.actor_silent_s`` + 5 s (its tickets
  are released, its late groups are stale), then SIGCONT;
- ``learner_kill``: SIGKILL of the learner (restarted from its newest checkpoint);
- ``launcher_kill``: SIGKILL of the launcher, then of the learner (``--resume`` refuses
  while one runs), then ``launch --resume RUN_DIR``: the actors are adopted;
- ``job_kill``: SIGKILL of every process of the run (the launcher, then the learner's and
  every actor's process group: a power loss, a node's OOM killer, ``scancel``), then
  ``launch --resume RUN_DIR``: the learner from its newest checkpoint, the actors from
  their journals of trees in flight (actors/journal.py);
- ``retriever_kill``: SIGKILL of the retriever; the soak restarts it on the same port
  after ``RETRIEVER_DOWN_S`` (meanwhile search calls fail and are counted);
- ``sandbox_kill``: SIGKILL of one of the actors' bubblewrap sandboxes (warm or running);
- ``cache_full``: the tool cache cannot grow for a while: each actor's soft RLIMIT_FSIZE
  is lowered to the size of the cache's database file (unprivileged; no tmpfs is
  needed), so inserts fail with EFBIG as on a full disk, then restored (on the actor and
  what it started meanwhile). Everything else the actor writes past that size (its log,
  the weight file in /dev/shm) fails too, as on a full disk;
- ``frames``: 200 fuzzed frame lists at the trajectory socket and 50 garbage requests
  at the control socket;
- ``slow_tool``: the proxy holds every new retriever connection 1.5 x
  ``tools.timeout_s`` for a while (search calls time out).

Every fault is a line of ``RUN_DIR/chaos.jsonl`` (time, kind, target, details). Once the
run ends (or ``--grace-s`` after ``--duration-s`` it is declared hung and killed), the
verdict (arpo_async/jobs/chaos_verdict.py) is printed as a table and written to
``RUN_DIR/chaos_verdict.json``; the exit code is 1 when any check fails. Every role
inherits ``ARPO_CHAOS_RUN=RUN_DIR``: that is how processes left behind are found.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from arpo_async.core.config import ConfigError, load_config
from arpo_async.core.files import atomic_write_json, read_json
from arpo_async.core.metrics import append_jsonl, read_metrics
from arpo_async.jobs import chaos_faults as F
from arpo_async.jobs.chaos_verdict import ancestors, run_processes, table, verdict
from arpo_async.jobs.pipeline import build_data, build_model
from arpo_async.jobs.sft import run_sft
from arpo_async.core.ports import free_port

REPO = Path(__file__).resolve().parents[2]
FAULTS = ("actor_kill", "actor_stop", "learner_kill", "launcher_kill", "job_kill", "retriever_kill",
          "sandbox_kill", "cache_full", "frames", "slow_tool")
MARKER_ENV = "ARPO_CHAOS_RUN"
RETRIEVER_DOWN_S = 3.0  # how long a killed retriever stays down
FRAMES_PER_FAULT = 200
# The soak's own settings, before the user's key=value overrides: faults are expected, so
# restarts are not limited; checkpoints often (a killed learner resumes from one) and
# all kept (each is verified at the end).
DEFAULTS = ["pipeline.enabled=false", "learner.checkpoint_every=5",
            "learner.keep_checkpoints=100000", "learner.max_steps=1000000",
            "learner.max_restarts=100000", "actors.max_restarts=100000",
            "actors.restart_backoff_s=1", "learner.restart_backoff_s=1",
            "learner.actor_silent_s=5"]


def add_arguments(p) -> None:
    p.add_argument("--duration-s", type=float, default=1800.0,
                   help="seconds of faults (and run.time_limit_s of the run)")
    p.add_argument("--fault-every-s", type=float, default=45.0,
                   help="mean seconds between faults")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma list of fault kinds (default: all of {','.join(FAULTS)})")
    p.add_argument("--sft-steps", type=int, default=300,
                   help="cold-start SFT steps before the run (so that the model calls tools)")
    p.add_argument("--startup-s", type=float, default=60.0,
                   help="allowance for a role's start-up in the gap bound, seconds")
    p.add_argument("--grace-s", type=float, default=900.0,
                   help="after --duration-s, how long the run may take to end before it "
                        "counts as hung")
    p.add_argument("--config", default=str(REPO / "configs" / "default.yaml"),
                   help="base YAML config (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def parse_faults(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FAULTS]
    if not kinds or bad:
        raise SystemExit(f"--faults: unknown kind(s) {bad or text!r}; choose from "
                         f"{','.join(FAULTS)}")
    return kinds


class Soak:
    """One chaos soak: the services, the launcher, the fault schedule."""

    def __init__(self, args, kinds: list[str]):
        self.args, self.kinds = args, kinds
        # the learner's clock starts before the actors are up (minutes on a busy machine):
        # its limit covers the start-up too, else a slow start ends the run at step 0
        limit = args.duration_s + args.startup_s
        self.overrides = DEFAULTS + [f"run.time_limit_s={limit}"] + args.overrides
        try:
            self.cfg = load_config(args.config, self.overrides)
        except ConfigError as exc:
            raise SystemExit(str(exc).splitlines()[0]) from None
        self.run_dir = Path(self.cfg.run.dir).resolve()
        if (self.run_dir / "chaos.jsonl").exists():
            raise SystemExit(f"run.dir: {self.run_dir} holds an earlier soak; choose a new one")
        self.cache_dir = Path(self.cfg.tools.cache_dir or self.run_dir / "tool_cache")
        self.rng = random.Random(args.seed)
        self.np_rng = __import__("numpy").random.default_rng(args.seed)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **{MARKER_ENV: str(self.run_dir)})
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.launcher: subprocess.Popen | None = None
        self.retriever: F.Retriever | None = None
        self.proxy: F.DelayProxy | None = None
        self.undo: list[tuple[float, object]] = []  # (when, callable): SIGCONT, limits
        self.retriever_dead_at: float | None = None
        self.extra: list[str] = []  # launch overrides prepare() adds (run dir, model, url)

    # ------------------------------------------------------------------ set-up
    def prepare(self) -> list[str]:
        """Data, model (SFT), retriever and proxy; the launch overrides."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        data = build_data(self.cfg) if self.cfg.task.name == "file" else None
        model = build_model(self.cfg)["path"]
        extra = [f"run.dir={self.run_dir}"]
        if self.args.sft_steps > 0:
            model = self._sft(model)
        extra.append(f"model.path={model}")
        if "search" in self.cfg.tools.enabled and not self.cfg.tools.search.retriever_url:
            if data is None:
                raise SystemExit("tools.enabled has search: give tools.search.retriever_url or "
                                 "task.name=file (the suite's corpus)")
            self.retriever = F.Retriever(Path(data["dir"]) / "corpus.jsonl",
                                         free_port("127.0.0.1"),
                                         self.run_dir / "logs" / "retriever.log", self.env)
            self.retriever.start()
            self.proxy = F.DelayProxy(self.retriever.port).start()
            extra.append(f"tools.search.retriever_url=http://127.0.0.1:{self.proxy.port}/retrieve")
        return extra

    def _sft(self, base: str) -> str:
        out = self.run_dir / "sft"
        if not (out / "config.json").exists():
            p = self.cfg.pipeline
            run_sft(base, Path(p.data_dir) / "sft.jsonl", out, steps=self.args.sft_steps,
                    lr=p.sft_lr, batch_size=p.sft_batch_size, seed=self.cfg.run.seed,
                    threads=p.threads, warmup_frac=p.sft_warmup_frac,
                    min_lr_frac=p.sft_min_lr_frac, max_len=self.cfg.model.max_model_len,
                    log=lambda s: None, chunk=p.sft_logprob_chunk_tokens)
        return str(out)

    def start_launcher(self, resume: bool = False) -> None:
        head = [sys.executable, "-m", "arpo_async.launch", "--quiet"]
        cmd = head + (["--resume", str(self.run_dir)] if resume
                      else ["--config", self.args.config, *self.overrides, *self.extra])
        with (self.run_dir / "launcher.out").open("ab") as out:
            # its own session: a SIGKILL of its group takes the launcher only (the roles
            # have sessions of their own), as when it crashes
            self.launcher = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    # ------------------------------------------------------------------ records
    def pids(self) -> dict:
        return read_json(self.run_dir / "processes.json") or {}

    def actors(self) -> list[tuple[str, int]]:
        return [(n, p) for n, p in sorted(self.pids().items())
                if n.startswith("actor") and not F.gone(p)]

    def steps(self) -> int:
        rows = read_metrics(self.run_dir)
        return rows[-1]["step"] if rows else 0

    def log(self, kind: str, target: str, **detail) -> None:
        row = {"time": time.time(), "kind": kind, "target": target, **detail}
        append_jsonl(self.run_dir / "chaos.jsonl", row)
        print(f"[chaos] {time.strftime('%H:%M:%S')} {kind} -> {target} "
              f"{json.dumps(detail) if detail else ''}", flush=True)

    # ------------------------------------------------------------------ faults
    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False when it found no target."""
        now = time.time()
        window = min(max(self.args.fault_every_s / 2, 5.0), 30.0)
        pids = self.pids()
        if kind in ("actor_kill", "actor_stop"):
            live = self.actors()
            if not live:
                return False
            name, pid = self.rng.choice(live)
            if kind == "actor_kill":
                F.signal_group(pid, signal.SIGKILL)
                self.log(kind, name, pid=pid)
            else:
                stall = self.cfg.learner.actor_silent_s + 5.0
                F.signal_group(pid, signal.SIGSTOP)
                self.undo.append((now + stall, lambda p=pid: F.signal_group(p, signal.SIGCONT)))
                self.log(kind, name, pid=pid, stall_s=stall)
        elif kind == "learner_kill":
            pid = pids.get("learner")
            if pid is None or F.gone(pid):
                return False
            F.signal_group(pid, signal.SIGKILL)
            self.log(kind, "learner", pid=pid)
        elif kind in ("launcher_kill", "job_kill"):
            self._kill_launcher_and_resume(pids, everything=kind == "job_kill")
        elif kind == "retriever_kill":
            pid = self.retriever.kill() if self.retriever else None
            if pid is None:
                return False
            self.retriever_dead_at = now
            self.log(kind, "retriever", pid=pid, down_s=RETRIEVER_DOWN_S)
        elif kind == "sandbox_kill":
            boxes = F.sandboxes([p for _, p in self.actors()])
            if not boxes:
                return False
            pid = self.rng.choice(boxes)
            F.signal_group(pid, signal.SIGKILL)
            self.log(kind, "sandbox", pid=pid)
        elif kind == "cache_full":
            return self._fill_cache(now + window)
        elif kind == "frames":
            t = self._ports()
            sent = F.send_garbage("127.0.0.1", t["trajectory_port"], t["control_port"],
                                  FRAMES_PER_FAULT, self.np_rng, t["max_message_mb"])
            self.log(kind, "learner sockets", **sent)
        elif kind == "slow_tool":
            if self.proxy is None:
                return False
            delay = 1.5 * self.cfg.tools.timeout_s
            self.proxy.slow(delay, now + window)
            self.log(kind, "search", delay_s=delay, for_s=window)
        return True

    def _kill_launcher_and_resume(self, pids: dict, everything: bool = False) -> None:
        """SIGKILL the launcher, then the learner (``--resume`` refuses while one runs) or,
        with ``everything``, every role; then ``launch --resume``."""
        F.signal_group(self.launcher.pid, signal.SIGKILL)
        self.launcher.wait(30)
        roles = {name: pid for name, pid in pids.items() if everything or name == "learner"}
        for pid in roles.values():
            if not F.gone(pid):
                F.signal_group(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(F.gone(p) for p in roles.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if everything:
            self.log("job_kill", "run", launcher_pid=self.launcher.pid, pids=roles)
        else:
            self.log("launcher_kill", "launcher", pid=self.launcher.pid,
                     learner_pid=roles.get("learner"))
        self.start_launcher(resume=True)

    def _fill_cache(self, until: float) -> bool:
        limit = max(F.cache_bytes(self.cache_dir), 4096)
        hit = []
        for name, pid in self.actors():
            before = F.limit_file_size(pid, limit)
            if before is not None:
                hit.append(name)
                self.undo.append((until, lambda p=pid, b=before: F.restore_file_size_tree(p, b)))
        if not hit:
            return False
        self.log("cache_full", ",".join(hit), fsize_limit=limit, for_s=round(until - time.time()))
        return True

    def _ports(self) -> dict:
        t = yaml.safe_load((self.run_dir / "config.yaml").read_text())["transport"]
        return t

    # ------------------------------------------------------------------ the soak
    def tick(self) -> None:
        """Undo what is due (SIGCONT, limits) and bring a killed retriever back."""
        now = time.time()
        due = [u for u in self.undo if u[0] <= now]
        self.undo = [u for u in self.undo if u[0] > now]
        for _, fn in due:
            fn()
        if self.retriever is not None and self.retriever_dead_at is not None \
                and now - self.retriever_dead_at >= RETRIEVER_DOWN_S:
            self.retriever.ensure()
            self.retriever_dead_at = None

    def wait_first_step(self) -> bool:
        deadline = time.monotonic() + self.args.startup_s * 5
        while self.steps() < 1:
            if self.launcher.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def faults(self) -> None:
        t_end = time.time() + self.args.duration_s
        every = self.args.fault_every_s
        next_at = time.time() + every * self.rng.uniform(0.5, 1.5)
        while time.time() < t_end and self.launcher.poll() is None:
            self.tick()
            if time.time() >= next_at:
                for _ in range(10):  # a kind without a target is drawn again
                    if self.inject(self.rng.choice(self.kinds)):
                        break
                next_at = time.time() + every * self.rng.uniform(0.5, 1.5)
            time.sleep(0.2)

    def finish(self) -> int | None:
        """Undo every pending fault, wait for the run to end; the launcher's code, or None
        when it hung (then everything of the run is killed)."""
        for _, fn in self.undo:
            fn()
        self.undo = []
        if self.proxy is not None:
            self.proxy.slow(0.0, 0.0)
        deadline = time.monotonic() + self.args.grace_s
        while self.launcher.poll() is None and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.5)
        if self.launcher.poll() is None:
            self.log("hang", "launcher", waited_s=self.args.grace_s)
            self.kill_everything()
            return None
        while self.retriever_dead_at is not None:  # killed just before the end: back too
            self.tick()
            time.sleep(0.2)
        return self.launcher.returncode

    def kill_everything(self) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            F.signal_group(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait(10)
        for pid in self.pids().values():
            F.signal_group(pid, signal.SIGCONT)
            F.signal_group(pid, signal.SIGKILL)

    def close_services(self) -> None:
        if self.retriever is not None:
            self.retriever.close()
        if self.proxy is not None:
            self.proxy.close()


def _settle(marker: str, run_dir: Path, timeout_s: float = 20.0) -> None:
    """Give processes that are exiting (a vLLM engine after its actor) time to go."""
    deadline = time.monotonic() + timeout_s
    while run_processes(marker, run_dir, ancestors(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.5)


def run(args) -> int:
    kinds = parse_faults(args.faults)
    if args.duration_s <= 0 or args.fault_every_s <= 0:
        raise SystemExit("--duration-s and --fault-every-s must be > 0")
    soak = Soak(args, kinds)
    rc = None
    try:
        soak.extra = soak.prepare()
        print(f"[chaos] run {soak.run_dir}, seed {args.seed}, faults {','.join(kinds)}, "
              f"one every {args.fault_every_s} s for {args.duration_s} s", flush=True)
        soak.start_launcher()
        if soak.wait_first_step():
            soak.faults()
        rc = soak.finish()
    except KeyboardInterrupt:
        soak.kill_everything()
    finally:
        soak.close_services()
    marker, mine = str(soak.run_dir), ancestors(os.getpid())
    _settle(marker, soak.run_dir)
    result = verdict(soak.run_dir, soak.cfg, rc, args.startup_s, soak.cache_dir,
                     soak.retriever.restarts if soak.retriever else 0, marker, mine)
    result |= {"seed": args.seed, "duration_s": args.duration_s,
               "fault_every_s": args.fault_every_s, "kinds": kinds, "startup_s": args.startup_s}
    atomic_write_json(soak.run_dir / "chaos_verdict.json", result)
    print(table(result), flush=True)
    for p in run_processes(marker, soak.run_dir, mine):  # counted above; now gone
        F.signal_group(p["pid"], signal.SIGKILL)
        try:
            os.kill(p["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    return 0 if result["ok"] else 1
