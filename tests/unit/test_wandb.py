"""W&B next to TensorBoard (``metrics.wandb``): offline, every metrics line and the resolved
config land in RUN_DIR/wandb, a restarted writer continues the same run, and without the
package the config is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arpo_async.core.config import SPINE_CONFIG, load_config
from arpo_async.core.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]


def records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (a LevelDB-style log: 32 KiB
    blocks of chunks, each with a 7-byte header: crc, length, type full/first/middle/last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        else:
            chunks.append(buf + chunk)
            buf = b""
    return [Record.FromString(c) for c in chunks]


def _finished(path: Path, timeout_s: float = 60.0) -> list:
    """The records of a run file once its ``exit`` record is there: ``finish()`` returns
    before W&B's service process has written the last records of an offline run."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in recs):
            return recs
        assert time.monotonic() < deadline, f"{path} never got its exit record"
        time.sleep(0.1)


def _history(run_dir: Path) -> tuple[list[dict], dict]:
    steps, config = [], {}
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for r in _finished(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                steps.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                              for i in r.history.item})
            elif kind in ("config", "run"):  # the resolved config travels with the run record
                update = r.config.update if kind == "config" else r.run.config.update
                config |= {i.key: json.loads(i.value_json) for i in update}
    return steps, config


def test_offline_run_holds_every_step_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(SPINE_CONFIG, [f"run.dir={tmp_path}", "metrics.wandb=true"])
    began = -1
    for first, last in ((1, 2), (3, 3)):  # a restarted learner continues the same run
        # W&B names an offline folder by the second it starts in: a restart in the same
        # second would share the first part's folder
        while int(time.time()) <= began:  # after the second the last part ended in
            time.sleep(0.05)
        w = MetricsWriter(tmp_path, tensorboard=False, wandb=cfg.metrics,
                          config=cfg.model_dump(mode="json"))
        for step in range(first, last + 1):
            w.write({"step": step, "reward_mean": 0.1 * step, "branch/p_mean": 0.5,
                     "service": {"dropped": {"stale": 1}}})
        w.close()
        began = int(time.time())
    steps, config = _history(tmp_path)
    logged = {int(s["_step"]): s for s in steps if "reward_mean" in s}
    assert sorted(logged) == [1, 2, 3]
    assert logged[3]["reward_mean"] == pytest.approx(0.3)
    assert logged[2]["branch/p_mean"] == 0.5 and logged[1]["service/dropped/stale"] == 1
    assert config["learner"]["max_steps"] == cfg.learner.max_steps
    assert config["metrics"]["wandb"] is True
    assert len(set((tmp_path / "wandb_id").read_text().split())) == 1
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 2  # both parts, one run id


def test_without_the_package_the_error_is_one_line(tmp_path):
    script = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'wandb':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from arpo_async.launch import main\n"
        f"sys.exit(main(['--config', {str(SPINE_CONFIG)!r}, '--dry-run', "
        f"'run.dir={tmp_path}', 'metrics.wandb=true']))\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == ["config error: metrics.wandb=true needs the wandb package: "
                     "pip install 'arpo_async[wandb]' (or pip install wandb)"]
