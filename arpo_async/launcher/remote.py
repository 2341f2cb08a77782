"""Actors on other machines: ``python -m arpo_async.launch actor --connect tcp://HOST:PORT
[--actor-id I] [--keys DIR] [--run-dir DIR] [--wait S] [key=value ...]``.

Where the config comes from: the learner. The actor asks the learner's control port for
the run's resolved config (``ConfigRequest`` -> ``ConfigReply``), so every learning
setting and the ports chosen at launch come from the one file the learner itself runs
with; a copied file could drift. Only keys that describe this machine may be overridden
here (``HOST_LOCAL_KEYS``: paths, this machine's memory and threads); anything else is
refused, naming the key. Without ``--actor-id`` the learner assigns the lowest free id at
or above ``actors.num``.

The actor then writes ``RUN_DIR/config.yaml`` on this machine (default: the learner's
run folder path + ``/actorI``), copies the CurveZMQ client keys from ``--keys`` (the
learner's ``RUN_DIR/keys``: ``client.key_secret`` and ``server.key``), and runs
``python -m actors.main`` as a child, restarting it after a crash with backoff up to
``actors.max_restarts`` times, as the launcher does for local actors. It exits 0 when the
learner ends the run, and 69 (``ExitCode.LEARNER_GONE``, not restarted) when the learner
has not answered for ``transport.connect_timeout_s``: its host vanished.

``learner.config_server.ConfigServer`` is the learner's side of the exchange.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from arpo_async.core.config import ConfigError, _set_dotted, config_from_dict, save_config
from arpo_async.core.keys import load_client_keys
from arpo_async.core.protocol import Ack, ConfigReply, ConfigRequest, ExitCode
from arpo_async.core.transport.control import ControlClient, TransportTimeout

log = logging.getLogger("arpo_async.launcher.remote")

HOST_LOCAL_KEYS = (
    "model.path", "task.data", "tools.cache_dir", "tools.search.retriever_url", "actors.threads",
    "actors.engine.kv_cache_gib", "actors.engine.gpu_memory_utilization",
    "actors.engine.tensor_parallel", "actors.engine.enable_prefix_caching",
    "actors.engine.cuda_graphs", "actors.concurrent_groups",
    "actors.max_inflight_trajectories",
    "transport.connect_timeout_s",
)
_CLIENT_FILES = ("client.key_secret", "server.key")


# ----------------------------------------------------------------------------- actor side


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (IPv6 as ``tcp://[::1]:PORT``) -> (host, port)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"--connect {endpoint!r}: expected tcp://HOST:PORT")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--connect {endpoint!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def local_config(learner_yaml: str, overrides: list[str], connect_host: str, control_port: int,
                 run_dir: str | None, actor_id: int):
    """The learner's config as this machine runs it: host-local overrides, this run
    folder, the learner reached at ``connect_host``. Raises ConfigError naming the key."""
    tree = yaml.safe_load(learner_yaml)
    if not isinstance(tree, dict):
        raise ConfigError("the learner sent a config that is not a mapping")
    learner_dir = tree.get("run", {}).get("dir", "runs/remote")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected key=value")
        if key.strip() not in HOST_LOCAL_KEYS:
            raise ConfigError(f"{key.strip()}: cannot be set on an actor machine (it must match "
                              f"the learner's config); allowed: {', '.join(HOST_LOCAL_KEYS)}")
        _set_dotted(tree, key.strip(), raw)
    tree["run"]["dir"] = run_dir or str(Path(learner_dir) / f"actor{actor_id}")
    tree["transport"]["host"] = connect_host
    tree["transport"]["control_port"] = control_port  # the port that answered from here
    tree["model"]["build_if_missing"] = False  # never a different random model here
    tree.get("learner", {})["deepspeed_config"] = ""  # the learner's file; actors never read it
    if not tree.get("tools", {}).get("cache_dir"):  # actors of one machine share a cache
        tree.setdefault("tools", {})["cache_dir"] = str(Path(learner_dir) / "tool_cache")
    return config_from_dict(tree)


def check_local_paths(cfg) -> list[str]:
    """Errors for files this machine must have; returns warnings."""
    model = cfg.model.path
    hub_like = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not Path(model).is_dir() and not hub_like:
        raise ConfigError(f"model.path={model} does not exist on this machine: copy the model "
                          "here or pass model.path=LOCAL_FOLDER")
    if cfg.task.name == "file" and not Path(cfg.task.data).is_file():
        raise ConfigError(f"task.data={cfg.task.data} does not exist on this machine: copy it "
                          "or pass task.data=LOCAL_FILE")
    if not Path(model).is_dir():
        return [f"model.path={model} is not a local folder: loaded from the Hugging Face cache"]
    return []


def install_keys(src: str | Path, run_dir: str | Path) -> Path:
    """Copy the CurveZMQ client keys into ``run_dir/keys`` (where actors.main looks)."""
    src, dst = Path(src), Path(run_dir) / "keys"
    missing = [name for name in _CLIENT_FILES if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--keys {src}: {', '.join(missing)} missing (copy them from "
                                "the learner's RUN_DIR/keys)")
    dst.mkdir(parents=True, exist_ok=True)
    os.chmod(dst, 0o700)
    for name in _CLIENT_FILES:
        shutil.copyfile(src / name, dst / name)
    os.chmod(dst / "client.key_secret", 0o600)
    return dst


async def fetch_config(endpoint: str, keys: Any, actor_id: int, wait_s: float,
                       max_bytes: int = 16 * 2**20) -> tuple[str, int]:
    """Ask the learner until it answers or ``wait_s`` passes (it may still be starting)."""
    client = ControlClient(endpoint, timeout_s=5.0, curve=keys, max_bytes=max_bytes)
    deadline = time.monotonic() + wait_s
    request = ConfigRequest(actor_id=actor_id, host=socket.gethostname(), pid=os.getpid())
    try:
        while True:
            try:
                reply = await client.request(request)
            except TransportTimeout:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no answer from the learner at {endpoint} within {wait_s:.0f} s: is it "
                        "running, are address and port right, and were the learner's CurveZMQ "
                        "keys passed with --keys?") from None
                log.info("waiting for the learner at %s", endpoint)
                continue
            if isinstance(reply, ConfigReply):
                return reply.config_yaml, reply.actor_id
            reason = reply.reason if isinstance(reply, Ack) else type(reply).__name__
            raise RuntimeError(f"the learner refused: {reason}")
    finally:
        client.close()


def run_child(cmd: list[str], env: dict[str, str], max_restarts: int,
              backoff_s: float = 2.0) -> int:
    """Run ``cmd``; restart it after a non-zero exit, up to ``max_restarts`` times with
    doubling backoff, except after ``ExitCode.LEARNER_GONE`` (returned as it is).
    SIGTERM/SIGINT stop the child and return 143/130."""
    stop: list[int] = []

    def on_signal(signum, _frame):
        stop.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    restarts = 0
    try:
        while True:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            while proc.poll() is None and not stop:
                time.sleep(0.2)
            if stop:
                _terminate(proc)
                return 130 if stop[0] == signal.SIGINT else 143
            code = proc.returncode
            if code == 0:
                return 0
            if code == ExitCode.LEARNER_GONE:  # a restart would wait for it as long again
                log.error("actor stopped: the learner did not answer for "
                          "transport.connect_timeout_s; not restarting it")
                return code
            if restarts >= max_restarts:
                log.error("actor exited with code %d after %d restarts; giving up", code,
                          restarts)
                return 1
            restarts += 1
            delay = min(backoff_s * 2 ** (restarts - 1), 30.0)
            log.warning("actor exited with code %d; restart %d/%d in %.0f s", code, restarts,
                        max_restarts, delay)
            time.sleep(delay)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arpo_async.launch actor",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                   help="the learner's control endpoint (transport.control_port)")
    p.add_argument("--actor-id", type=int, default=-1, help="default: the learner assigns one")
    p.add_argument("--keys", metavar="DIR",
                   help="folder with the learner's client.key_secret and server.key")
    p.add_argument("--run-dir", help="run folder on this machine (default: the learner's "
                   "run.dir/actorI)")
    p.add_argument("--wait", type=float, default=900.0,
                   help="seconds to wait for the learner to answer (default 900)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help=f"host-local overrides: {', '.join(HOST_LOCAL_KEYS)}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s remote-actor %(message)s")
    try:
        host, port = parse_endpoint(args.connect)
        keys = load_client_keys(args.keys) if args.keys else None
        text, actor_id = asyncio.run(fetch_config(args.connect, keys, args.actor_id, args.wait))
        cfg = local_config(text, args.overrides, host, port, args.run_dir, actor_id)
        for warning in check_local_paths(cfg):
            log.warning("%s", warning)
    except (ConfigError, ValueError, FileNotFoundError, TimeoutError, RuntimeError) as exc:
        print(f"actor error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run.dir)
    config_path = run_dir / "config.yaml"
    save_config(cfg, config_path)
    if args.keys:
        install_keys(args.keys, run_dir)
    log.info("actor %d: config in %s, learner at %s", actor_id, config_path, args.connect)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(cfg.actors.threads))
    cmd = [sys.executable, "-m", "actors.main", "--config", str(config_path),
           "--actor-id", str(actor_id)]
    return run_child(cmd, env, cfg.actors.max_restarts, cfg.actors.restart_backoff_s)
