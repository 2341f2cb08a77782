"""Helpers shared by the fault tests (tests/integration/test_faults_*.py): a launcher run
in the background and what it writes in its run folder, the ledger invariant, and
signals to a role's whole process group (arpo_async/jobs/chaos_faults.py, which the
chaos soak uses too).

A plain module, not a test file: import it as ``from tests.integration.faultkit import
...`` (the repository root is on sys.path, as for ``tests.conftest``)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from arpo_async.jobs.chaos_faults import gone, signal_group  # shared with the chaos soak
from tests.conftest import PY, REPO, SPINE, python_env

__all__ = ["Run", "check_ledger", "gone", "signal_group"]


class Run:
    """A launcher started in the background, and what it writes in its run folder."""

    def __init__(self, run_dir: Path, model: Path | None, *overrides: str,
                 env: dict | None = None):
        """A new run of the spine config; ``model=None``: ``launch --resume run_dir``."""
        self.dir = run_dir
        self.out = (run_dir.parent / f"{run_dir.name}.out").open("a" if model is None else "w")
        cmd = [PY, "-m", "arpo_async.launch", "--quiet"] + (
            ["--resume", str(run_dir)] if model is None else
            ["--config", SPINE, f"run.dir={run_dir}", f"model.path={model}",
             "learner.loss.entropy_coef=0.01", *overrides])
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=python_env() | (env or {}),
                                     stdout=self.out, stderr=subprocess.STDOUT)

    def rows(self) -> list[dict]:
        from arpo_async.core.metrics import read_metrics

        return read_metrics(self.dir)

    def step(self) -> int:
        rows = self.rows()
        return rows[-1]["step"] if rows else 0

    def pids(self) -> dict:
        return json.loads((self.dir / "processes.json").read_text())

    def events(self) -> list[dict]:
        path = self.dir / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def state(self) -> dict:
        """RUN_DIR/state.json: the learner's run state after its latest step (written
        atomically), with the per-actor ledger; {} before the first step."""
        from arpo_async.core import files as F
        from arpo_async.core import rundir as R

        return F.read_json(self.dir / R.RUN_STATE) or {}

    def role_log(self, name: str) -> str:
        path = self.dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited ({self.proc.returncode}) waiting for "
                                     f"{what}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")
            time.sleep(0.2)

    def finish(self, timeout: float = 400) -> dict:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.out.close()
        assert rc == 0, self.log()
        return json.loads((self.dir / "summary.json").read_text())

    def log(self) -> str:
        text = (self.dir.parent / f"{self.dir.name}.out").read_text()[-3000:]
        for name in ("learner", "actor0", "actor1"):
            path = self.dir / "logs" / f"{name}.log"
            if path.exists():
                text += f"\n--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:])
        return text


def check_ledger(ledger: dict) -> None:
    """Every group an actor sent is trained, dropped with a reason, or counted lost."""
    for actor, led in ledger.items():
        assert led["received"] == led["trained"] + sum(led["dropped"].values()), (actor, led)
        assert led["sent"] == led["received"] + led["lost"], (actor, led)
