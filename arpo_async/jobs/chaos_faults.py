"""The faults of the chaos soak (arpo_async/jobs/chaos.py), and the services the soak runs
beside the launcher so that it can break them: the retriever (restarted on its port when
it dies) behind a delaying TCP proxy (the "slow tool").

Each injector acts on real processes and files of a run and returns what it hit (a dict
for RUN_DIR/chaos.jsonl), or None when it found no target (the caller draws again).
The frame fuzzer (``fuzz_frames``) is shared with tests/integration/test_faults_frames.py.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import zmq

from arpo_async.core.protocol import (
    PROTOCOL_VERSION,
    Hello,
    Trajectory,
    TrajectoryGroup,
    encode,
)

# ----------------------------------------------------------------------------- processes


def signal_group(pid: int, sig: int) -> bool:
    """``sig`` to the process group of ``pid`` (roles run in their own sessions: engine
    workers and torchrun ranks included); False when it is gone."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def gone(pid: int) -> bool:
    """The process exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return True


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/PID/task/*/children)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            out += [int(x) for x in text.split()]
    except OSError:
        pass
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def sandboxes(actor_pids: list[int]) -> list[int]:
    """The bubblewrap sandboxes (warm or running a call) the actors started: children of
    an actor whose command is bwrap (toolenv/sandbox.py starts them in their own
    session, so they are not in the actor's process group)."""
    return [c for pid in actor_pids for c in children(pid)
            if Path(cmdline(c)[0] if cmdline(c) else "").name == "bwrap" and not gone(c)]


# ----------------------------------------------------------------------------- cache


def limit_file_size(pid: int, limit_bytes: int) -> tuple[int, int] | None:
    """Lower the soft RLIMIT_FSIZE of a live process (unprivileged: only lowering the soft
    limit of one's own processes); the limits before, or None if it is gone. Writes past
    the limit fail with EFBIG (Python ignores SIGXFSZ), as on a full disk."""
    try:
        before = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit_bytes, before[1]))
        return before
    except (ProcessLookupError, PermissionError, OSError):
        return None


def restore_file_size(pid: int, limits: tuple[int, int]) -> None:
    try:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def restore_file_size_tree(pid: int, limits: tuple[int, int]) -> None:
    """Restore the limit on ``pid`` and every process below it (a vLLM engine started
    while the limit was low inherited it)."""
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        restore_file_size(p, limits)
        todo += children(p)


def cache_bytes(cache_dir: Path) -> int:
    """The size of the cache's main database file. With the file-size limit there, an
    insert fails: its frame goes into the write-ahead log past that offset (the log is
    reused from its start after a checkpoint, so limiting at the log's size, as the first
    soak did, let every insert through)."""
    path = cache_dir / "cache.db"
    return path.stat().st_size if path.is_file() else 0


# ----------------------------------------------------------------------------- frames


def _valid_group_frames(rng: np.random.Generator) -> list[bytes]:
    n = int(rng.integers(1, 20))
    leaf = Trajectory(tokens=rng.integers(0, 100, n, dtype=np.int32),
                      loss_mask=np.ones(n, np.uint8), logprobs=-rng.random(n, np.float32),
                      versions=np.zeros(n, np.int32))
    group = TrajectoryGroup("fuzz", 0, "p", np.arange(1, 5, dtype=np.int32), [leaf])
    return [bytes(f) for f in encode(group)]


def _with_header(frames: list[bytes], change) -> list[bytes]:
    header = msgpack.unpackb(frames[0], raw=False)
    change(header)
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


def _bad_semantics(kind: int) -> list[bytes]:
    """Groups that decode but must not be trained on (learner/service.py check_group)."""
    n = 8
    fields = dict(tokens=np.arange(1, n + 1, dtype=np.int32), loss_mask=np.ones(n, np.uint8),
                  logprobs=np.full(n, -1.0, np.float32), versions=np.zeros(n, np.int32))
    bad = [{"tokens": np.full(n, 10**6, np.int32)}, {"tokens": np.full(n, -5, np.int32)},
           {"logprobs": np.full(n, np.nan, np.float32)}, {"loss_mask": np.full(n, 7, np.uint8)},
           {"parent": 0, "branch_point": 2}, {"reward": float("nan")},
           {"versions": np.full(n, -9, np.int32)}][kind % 7]
    group = TrajectoryGroup("fuzz", 0, "p", np.arange(1, 4, dtype=np.int32),
                            [Trajectory(**(fields | bad))])
    return [bytes(f) for f in encode(group)]


def fuzz_frames(rng: np.random.Generator, i: int, max_mb: float = 8) -> list[bytes]:
    """Frame list number ``i`` for the trajectory socket: every one must be rejected
    (random bytes, truncated or lying headers, wrong versions, kinds and types, oversized
    messages, groups that decode but are not trainable)."""
    kind = i % 10
    if kind == 0:  # random bytes
        return [rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))]
    frames = _valid_group_frames(rng)
    if kind == 1:  # truncated header
        return [frames[0][:int(rng.integers(0, len(frames[0])))]] + frames[1:]
    if kind == 2:  # a frame missing or one too many
        return frames[:-1] if rng.random() < 0.5 else frames + [b"extra"]
    if kind == 3:  # wrong protocol version
        v = PROTOCOL_VERSION  # around the real one: the next, its string and float, a bool
        bad = [0, v + 1, 99, -1, str(v), float(v), True, None][int(rng.integers(0, 8))]
        return _with_header(frames, lambda h: h.__setitem__("p", bad))
    if kind == 4:  # unknown kind
        return _with_header(frames, lambda h: h.__setitem__("kind", f"kind{i}"))
    if kind == 5:  # wrong types in valid msgpack
        key, wrong = [("group_id", [7, 1.5, None, [1]]), ("actor_id", ["0", 1.5, None, True]),
                      ("prompt_id", [3, None, {"a": 1}, b"p"]),
                      ("leaves", [5, "x", None, {"a": 1}, [1, 2]]),
                      ("created_at", ["now", None, [1.0], True])][i % 5]
        value = wrong[int(rng.integers(0, len(wrong)))]
        return _with_header(frames, lambda h: h["body"].__setitem__(key, value))
    if kind == 6:  # array specs lying about sizes
        return _with_header(frames, lambda h: h["arrays"][1].__setitem__(
            2, [int(rng.integers(21, 10**6))]))
    if kind == 7:  # oversized: over max_message_mb, under libzmq's hard limit (2x)
        if i % 500 == 7:
            return [rng.bytes(int(max_mb * 2**20 * 1.2))]
        return [frames[0][:int(rng.integers(1, len(frames[0])))]]  # keep the run fast
    if kind == 8:  # a valid message of the wrong kind for this socket
        return [bytes(f) for f in encode(Hello(actor_id=0, pid=i))]
    return _bad_semantics(i)


def send_garbage(host: str, trajectory_port: int, control_port: int, n: int,
                 rng: np.random.Generator, max_mb: float) -> dict:
    """``n`` fuzzed frame lists at the trajectory socket and ``n`` // 4 garbage requests
    at the control socket (random bytes behind a request id, or none), then hang up."""
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.sndhwm, push.linger = 100, 5_000
        push.connect(f"tcp://{host}:{trajectory_port}")
        for _ in range(n):
            push.send_multipart(fuzz_frames(rng, int(rng.integers(0, 10**6)), max_mb))
        dealer = ctx.socket(zmq.DEALER)
        dealer.sndhwm, dealer.linger = 100, 1_000
        dealer.connect(f"tcp://{host}:{control_port}")
        for _ in range(n // 4):
            frames = [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 4)))]
            dealer.send_multipart(frames)
        push.close()
        dealer.close()
    finally:
        ctx.term()  # waits (linger) until the frames left or the linger ran out
    return {"trajectory_frames": n, "control_frames": n // 4}


# ----------------------------------------------------------------------------- services


class DelayProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port`` (the retriever), in its own
    thread. ``slow(delay_s, until)`` holds every request ``delay_s`` (each chunk a client
    sends, on new and kept-alive connections alike) until ``until`` (time.time()): the
    search tool then sees a slow service, and its calls time out past
    ``tools.timeout_s``."""

    def __init__(self, upstream_port: int):
        self.upstream_port, self.port = upstream_port, 0
        self.delay_s, self.until, self.connections, self.delayed = 0.0, 0.0, 0, 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)

    def start(self) -> DelayProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def slow(self, delay_s: float, until: float) -> None:
        self.delay_s, self.until = delay_s, until

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the retriever is down: the client sees the connection close
            writer.close()
            return

        async def pipe(src, dst, slowed: bool) -> None:
            try:
                while data := await src.read(65536):
                    if slowed and time.time() < self.until:
                        self.delayed += 1
                        await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


class Retriever:
    """The BM25 retriever (``python -m toolenv serve-retriever``) on a fixed port, as a
    supervised child: ``ensure()`` restarts it when it died (SIGKILL is one of the
    faults), and counts the restarts."""

    def __init__(self, corpus: Path, port: int, log: Path, env: dict[str, str]):
        self.corpus, self.port, self.log, self.env = corpus, port, log, env
        self.proc: subprocess.Popen | None = None
        self.restarts, self.down_since = 0, None

    def start(self, timeout_s: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "toolenv", "serve-retriever", "--corpus", str(self.corpus),
               "--port", str(self.port), "--exit-with-parent"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"retriever on port {self.port} did not start (see {self.log})")

    def ensure(self) -> bool:
        """Restart a dead retriever; True when it did."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.start()
        self.restarts += 1
        return True

    def kill(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        return self.proc.pid

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
