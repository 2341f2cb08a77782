"""Beyond one machine, on one machine: a "learner host" and two "actor hosts", each a
network namespace with its own address and hostname (tests/integration/netns.py). The
learner binds its host's address with CurveZMQ keys; the actors join with exactly the
commands ``launch --dry-run`` prints for ``cluster.remote_actors``, each from its own
working folder, where the client keys were copied as docs/scale-out.md says.

The actors run ``actors.engine=simulated``: the real actor process, sockets, tickets,
weights and ledger, and the real DeepSpeed learner, with tokens paced by the clock
(``actors.engine.tokens_per_s``) instead of a model, which is all these tests are about.

One run (module fixture ``cut_run``) checks the join, a client without the keys
(refused and counted), an actor host whose cable is pulled for 20 s (the learner goes on
with the other; the cut actor's in-flight groups are counted; it rejoins as the same
process) and then the other actor host pulled for good (the run finishes and names it).
A second run pulls the learner host's cable: both actors stop with exit code 69 after
``transport.connect_timeout_s``.

Pacing (the runs' shape does not depend on this machine's speed): each actor generates
one group at a time (``actors.max_inflight_trajectories = 4`` = ``rollout.group_size``),
so it nearly always holds a ticket (the cut must catch one in flight), and a group takes
at least ``16 / actors.engine.tokens_per_s = 1 s``: the learner takes at most one step per second
with both actors and half that with one. 32 steps then leave at least 10 s for the
rejoin after 20 s of cut, and a few steps after the other host is gone for good.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.conftest import PY, python_env
from tests.integration import netns

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOSTS = ["learner", "a0", "a1"]
TRAJ_PORT, CTRL_PORT = 29610, 29611  # free for sure: nothing else lives on these hosts
CUT_S = 20.0


@pytest.fixture(scope="module")
def hosts():
    yield from netns.hosts_or_skip(HOSTS)


class Run:
    """One learner (launcher) on the learner host and one remote actor per actor host."""

    def __init__(self, hosts: netns.Hosts, root: Path, model: Path, **learner: dict):
        self.hosts, self.root, self.procs = hosts, root, []
        self.dirs = {n: root / f"{n}_host" for n in HOSTS}
        for d in self.dirs.values():
            d.mkdir(parents=True)
        self.run_dir = self.dirs["learner"] / "run"
        cfg = {
            "run": {"dir": "run"}, "model": {"path": str(model)},
            "actors": {"num": 0, "start_wait_s": 120, "max_restarts": 0,
                       "max_inflight_trajectories": 4,
                       "engine": {"type": "simulated", "tokens_per_s": 16,
                                  "round_tokens_min": 16, "round_tokens_max": 16,
                                  "chunk_tokens": 2}},
            "cluster": {"remote_actors": [{"host": hosts.addr[n], "actors": 1}
                                          for n in ("a0", "a1")]},
            "transport": {"host": hosts.addr["learner"], "trajectory_port": TRAJ_PORT,
                          "control_port": CTRL_PORT, "request_timeout_s": 5},
            "rollout": {"mode": "grpo", "group_size": 4, "initial_samples": 4},
            "sampling": {"round_max_tokens": 16, "max_response_tokens": 32},
            "learner": {"batch_groups": 2, "max_staleness": 1, "actor_silent_s": 3,
                        "shutdown_wait_s": 5, "wait_timeout_s": 120},
        }
        for section, values in learner.items():
            cfg[section].update(values)
        (self.dirs["learner"] / "cluster.yaml").write_text(yaml.safe_dump(cfg))

    def _start(self, host: str, argv: list[str], log: str) -> subprocess.Popen:
        out = (self.root / log).open("w")
        proc = subprocess.Popen(self.hosts.command(host, argv), cwd=self.dirs[host],
                                env=python_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        """Keys, the plan, the learner, and the actors as the plan says, keys copied."""
        here = dict(cwd=self.dirs["learner"], env=python_env(), capture_output=True,
                    text=True, timeout=120)
        made = subprocess.run([PY, "-m", "arpo_async.core.keys", "run"], **here)
        assert made.returncode == 0, made.stderr
        dry = subprocess.run([PY, "-m", "arpo_async.launch", "--config", "cluster.yaml",
                              "--dry-run"], **here)
        assert dry.returncode == 0, dry.stderr
        self.commands = _remote_commands(dry.stdout, self.hosts)
        assert sorted(self.commands) == ["a0", "a1"], dry.stdout
        self.learner = self._start("learner", [PY, "-m", "arpo_async.launch", "--config",
                                               "cluster.yaml"], "launcher.log")
        self.actors = {}
        for host, line in self.commands.items():
            words = shlex.split(line)
            assert words[:4] == ["python", "-m", "arpo_async.launch", "actor"], line
            keys = Path(words[words.index("--keys") + 1])
            (self.dirs[host] / keys).mkdir(parents=True)  # "scp ... node-b:$PWD/RUN/keys/"
            for name in ("client.key_secret", "server.key"):
                shutil.copyfile(self.dirs["learner"] / keys / name, self.dirs[host] / keys / name)
            self.actors[host] = self._start(host, [PY, *words[1:]], f"{host}.log")

    def keyless(self, host: str) -> subprocess.Popen:
        """``launch actor --connect`` as the docs say it, but without --keys."""
        return self._start(host, [PY, "-m", "arpo_async.launch", "actor", "--connect",
                                  f"tcp://{self.hosts.addr['learner']}:{CTRL_PORT}",
                                  "--wait", "5"], f"keyless-{host}.log")

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [{**row.get("service", {}), **row} for row in map(json.loads, lines)]

    def wait_row(self, pred, what: str, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.rows()
            if rows and pred(rows[-1]):
                return rows[-1]
            assert self.learner.poll() is None, f"the run ended before {what}: {self.tail()}"
            time.sleep(0.2)
        raise AssertionError(f"no metrics row with {what} within {timeout_s:.0f} s")

    def learner_said(self, pattern: str) -> list[tuple[float, re.Match]]:
        """(time, match) of the learner's log lines that match ``pattern``."""
        log = self.run_dir / "logs" / "learner.log"
        out = []
        for line in log.read_text(errors="replace").splitlines():
            m = re.search(pattern, line)
            if m:
                out.append((datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp(), m))
        return out

    def released_after(self, actor_id: int, t0: float, timeout_s: float) -> int:
        """Tickets of ``actor_id`` the learner released as silent after ``t0`` (0: none
        within ``timeout_s``): groups it had granted and not yet received."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self.learner_said(rf"actor {actor_id} silent for .* released its (\d+)")
            found = [int(m.group(1)) for t, m in lines if t >= t0]
            if found:
                return found[0]
            time.sleep(0.2)
        return 0

    def log(self, name: str) -> str:
        return (self.root / name).read_text(errors="replace")

    def tail(self) -> str:
        return self.log("launcher.log")[-3000:]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _remote_commands(plan_text: str, hosts: netns.Hosts) -> dict[str, str]:
    """actor host -> the line the plan says to run there."""
    by_addr = {hosts.addr[n]: n for n in HOSTS}
    lines, out = plan_text.splitlines(), {}
    for i, line in enumerate(lines):
        if " (start on " in line:
            addr = line.split(" (start on ")[1].split(";")[0]
            out[by_addr[addr]] = lines[i + 1].strip()
    return out


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


# ----------------------------------------------------------------------------- run 1


def _scenario(run: Run, seen: dict) -> None:
    """join and keyless client; a1's cable out for CUT_S and back; a0's out for good."""
    run.start()
    run.wait_row(lambda r: True, "a first step")
    seen["keyless"] = run.keyless("a0")  # the learner's sockets are bound by now
    run.wait_row(lambda r: r.get("actor0/trained", 0) > 0 and r.get("actor1/trained", 0) > 0,
                 "both actors trained")
    # the cut must catch actor 1 with groups in flight: the learner says so when it
    # releases their tickets (after learner.actor_silent_s); if it held none, the cable
    # goes back in, and once it trains again it is pulled again
    for cuts in range(1, 4):
        seen["cuts"] = cuts
        before = run.rows()[-1]
        run.hosts.link("a1", "down")
        t_cut = time.time()
        seen["in_flight"] = run.released_after(1, t_cut, timeout_s=8.0)
        if seen["in_flight"]:
            break
        run.hosts.link("a1", "up")
        run.wait_row(lambda r, b=before: r.get("actor1/trained", 0) > b["actor1/trained"],
                     "actor 1 trained again after a cut that caught nothing in flight")
    assert seen["in_flight"], "three cuts caught actor 1 without a group in flight"
    time.sleep(max(0.0, t_cut + CUT_S - time.time()))
    rows = run.rows()
    # what was on the wire at the cut arrives at once; the first step 2 s later or more
    # shows what the learner had then, and nothing more may come until the link is back
    settled = next((r for r in rows if r["time"] >= t_cut + 2.0), None)
    alone = [r for r in rows if r["time"] >= t_cut + 5.0]  # actor 1 silent > actor_silent_s
    during = rows[-1]
    run.hosts.link("a1", "up")
    t_up = time.time()
    back = run.wait_row(lambda r: r.get("actor1/trained", 0) > during.get("actor1/trained", 0),
                        "actor 1 trained again after its cut")
    t_trained = time.time()
    run.hosts.link("a0", "down")  # for good
    gone_at = run.rows()[-1]
    assert _wait_exit(run.learner, 300) == 0, run.tail()
    seen.update(before=before, settled=settled, alone=alone, during=during, back=back,
                gone_at=gone_at, t_cut=t_cut, t_up=t_up, t_trained=t_trained,
                hellos=[t for t, _ in run.learner_said(r"learner.service actor 1 connected")],
                a1_exit=_wait_exit(run.actors["a1"], 60), a0_running=run.actors["a0"].poll(),
                keyless_exit=_wait_exit(seen["keyless"], 60),
                summary=json.loads((run.run_dir / "summary.json").read_text()))


@pytest.fixture(scope="module")
def cut_run(hosts, tiny_model_dir, tmp_path_factory):
    run = Run(hosts, tmp_path_factory.mktemp("cut"), tiny_model_dir,
              learner={"max_steps": 32}, transport={"connect_timeout_s": 300})
    seen: dict = {}
    t0 = time.monotonic()
    try:
        _scenario(run, seen)
    finally:
        run.stop()
        for name in HOSTS[1:]:
            hosts.link(name, "up")
    seen["wall_s"] = time.monotonic() - t0
    seen["run"] = run
    return seen


def test_remote_actors_join_over_curve_and_train(cut_run):
    run, summary = cut_run["run"], cut_run["summary"]
    assert summary["status"] == "ok" and summary["steps"] == 32, summary
    assert set(summary["ledger"]) == {"0", "1"}, summary["ledger"]
    learner_cfg = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert learner_cfg["transport"]["host"] == run.hosts.addr["learner"]
    for i, host in enumerate(("a0", "a1")):  # each ran the learner's config on its host
        local = yaml.safe_load((run.dirs[host] / "run" / f"actor{i}" / "config.yaml").read_text())
        assert local["sampling"] == learner_cfg["sampling"]
        assert local["transport"]["host"] == run.hosts.addr["learner"]
        assert (run.dirs[host] / "run" / f"actor{i}" / "keys" / "client.key_secret").exists()
        assert "--keys run/keys" in run.commands[host]
    assert cut_run["a1_exit"] == 0, run.log("a1.log")[-3000:]
    print(f"\nnetns run: {cut_run['wall_s']:.0f} s; ledger {summary['ledger']}")


def test_a_client_without_the_keys_is_refused_and_counted(cut_run):
    run, summary = cut_run["run"], cut_run["summary"]
    out = run.log("keyless-a0.log")
    assert cut_run["keyless_exit"] == 2 and "keys passed with --keys" in out, out
    rejected = summary["learner"]["rejected"]
    assert rejected.get("control/handshake_failed", 0) >= 1, rejected
    assert set(summary["ledger"]) == {"0", "1"}  # it never became an actor


def test_an_actor_host_that_vanishes_is_counted_and_rejoins(cut_run):
    s, summary = cut_run, cut_run["summary"]
    before, during = s["before"], s["during"]
    # the learner went on with actor 0 alone, and heard nothing from actor 1
    settled, alone = s["settled"], s["alone"]
    assert settled is not None and alone, "the learner took no step during the cut"
    assert during["actor0/trained"] > before["actor0/trained"]
    assert during["actor1/received"] == settled["actor1/received"], (settled, during)
    assert all(r["actors_alive"] == 1 for r in alone), [r["actors_alive"] for r in alone]
    # actor 1 came back as the same process (no restart), said Hello again, trained
    led = summary["ledger"]["1"]
    rejoined = [t for t in s["hellos"] if t >= s["t_up"] - 0.5]  # log times: ms
    assert led["incarnations"] == 1 and rejoined, (led, s["hellos"], s["t_up"])
    assert summary["learner"]["events"].get("actor_reconnects", 0) >= 1
    assert summary["learner"]["admission"].get("released_actor_silent", 0) >= 1
    # its groups in flight at the cut arrived late (dropped stale, or trained after all
    # and adopted: only actor 1 came back) or were lost, or were drawn again: the
    # learner's reply to its Hello did not list them yet, so the actor drew them again
    # (actors/actor.py _plan_redo) and one of the two copies was dropped as a duplicate.
    # Every one counted
    assert led["sent"] == led["received"] + led["lost"], led
    assert led["received"] == led["trained"] + sum(led["dropped"].values()), led
    adopted = summary["learner"]["admission"].get("adopted", 0)
    late = (led["lost"] + led["dropped"].get("stale", 0) + adopted
            + led["dropped"].get("duplicate", 0))
    assert late >= s["in_flight"] >= 1, (led, adopted, s["in_flight"])
    # and no more than the window (4 groups) per cut went stale: a slot leaked by a cut
    # would have dropped groups for the rest of the run (Admission.adopt)
    assert led["dropped"].get("stale", 0) <= 4 * s["cuts"], led
    rejoin_s = rejoined[0] - s["t_up"]
    print(f"\nactor host cut {CUT_S:.0f} s ({s['cuts']} cut(s); {s['in_flight']} group(s) in "
          f"flight): Hello again {rejoin_s:.1f} s after the link came up, trained again after "
          f"{s['t_trained'] - s['t_up']:.1f} s; ledger 1: {led}; adopted {adopted}")


def test_an_actor_host_gone_for_good_is_named_in_the_summary(cut_run):
    run, summary = cut_run["run"], cut_run["summary"]
    assert summary["status"] == "ok" and summary["steps"] > cut_run["gone_at"]["step"]
    gone = summary["actors_not_back"]
    assert [g["actor"] for g in gone] == [0] and gone[0]["host"] == "a0-host", gone
    assert gone[0]["received"] == summary["ledger"]["0"]["received"]
    assert gone[0]["said_sent"] >= gone[0]["received"] > 0
    assert summary["ledger"]["0"]["sent"] == -1  # it never said Bye: its total is open
    assert cut_run["a0_running"] is None  # still waiting for the learner, not restarted
    assert "never came back" in run.log("launcher.log")
    print(f"\nactor host gone for good: {gone}")


# ----------------------------------------------------------------------------- run 2


def test_actors_stop_cleanly_when_the_learner_host_vanishes(hosts, tiny_model_dir, tmp_path):
    wait_s = 10.0
    run = Run(hosts, tmp_path, tiny_model_dir, learner={"max_steps": 1000},
              transport={"connect_timeout_s": wait_s})
    try:
        run.start()
        run.wait_row(lambda r: r.get("actor0/trained", 0) > 0 and r.get("actor1/trained", 0) > 0,
                     "both actors trained")
        hosts.link("learner", "down")  # for good
        t_cut = time.monotonic()
        codes = {h: _wait_exit(p, wait_s + 120) for h, p in run.actors.items()}
        stopped_s = time.monotonic() - t_cut
    finally:
        run.stop()
        hosts.link("learner", "up")
    for host in ("a0", "a1"):
        out = run.log(f"{host}.log")
        assert codes[host] == 69, (codes, out[-3000:])
        assert "retrying (learner down?)" in out, out[-3000:]  # it backed off first
        assert f"no answer from the learner for transport.connect_timeout_s={wait_s:g} s" in out
        assert "not restarting it" in out and "restart 1/" not in out
    print(f"\nlearner host gone: both actors stopped (exit 69) {stopped_s:.1f} s after the cut "
          f"(transport.connect_timeout_s={wait_s:g}, transport.request_timeout_s=5)")
