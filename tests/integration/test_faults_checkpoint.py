"""Faults injected into checkpoint writes (issue 7): a writer SIGKILLed at each point of a
write, and at random moments, always leaves a newest checkpoint that transformers loads
with exactly the weights written for its step. The writer is
tests/integration/faults_crash_writer.py, run in a subprocess."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PY, REPO, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WRITER = Path(__file__).with_name("faults_crash_writer.py")


def _latest_loads(run_dir: Path, model_dir: Path) -> int:
    """The step of the newest complete checkpoint, after checking that transformers loads
    it with exactly the weights written for that step."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from arpo_async.core import rundir as R
    from learner import checkpoint as C

    ckpt = R.latest_checkpoint(run_dir)
    step = C.read_meta(ckpt)["step"]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    params = dict(model.named_parameters())
    for name, value in load_file(str(model_dir / "model.safetensors")).items():
        if name in params:
            np.testing.assert_array_equal(params[name].detach().numpy(), value + step)
    assert (ckpt / "optimizer.bin").stat().st_size == 24_000_000
    return step


def _writer(run_dir: Path, model_dir: Path, crash_at: str, first: int) -> subprocess.Popen:
    return subprocess.Popen([PY, str(WRITER), str(run_dir), str(model_dir), crash_at,
                             str(first)], cwd=REPO, env=python_env(), stdout=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("crash_at, survivor", [
    ("after_optimizer", 2),  # inside the partial folder
    ("before_replace:step-00000003", 2),  # everything written and synced, not renamed
    ("after_replace:step-00000003", 3),  # renamed, the pointer still names step 2
    ("after_replace:latest", 3),  # before old checkpoints are pruned
])
def test_sigkill_at_each_point_of_a_checkpoint_write_leaves_one_loadable(
        tiny_model_dir, tmp_path, crash_at, survivor):
    """Steps 1 and 2 are written, then the writer SIGKILLs itself during step 3."""
    proc = _writer(tmp_path, tiny_model_dir, crash_at, 1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and f"dying {crash_at} 3" in out, out
    assert _latest_loads(tmp_path, tiny_model_dir) == survivor
    # the next write cleans up and moves on
    proc = _writer(tmp_path, tiny_model_dir, "none", 4)
    assert proc.wait(120) == 0
    assert _latest_loads(tmp_path, tiny_model_dir) == 4
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))


def test_sigkill_at_random_moments_of_checkpoint_writes(tiny_model_dir, tmp_path):
    rng = np.random.default_rng(11)
    kills, last = 0, 0
    for _ in range(5):
        proc = _writer(tmp_path, tiny_model_dir, "never", last + 1)
        lines: list[str] = []
        reader = threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout),
                                  daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not any(x.startswith("done") for x in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(float(rng.uniform(0.0, 0.4)))  # somewhere inside a later write
        proc.kill()
        proc.wait()
        reader.join(5)
        kills += 1
        done = [int(x.split()[1]) for x in lines if x.startswith("done")]
        step = _latest_loads(tmp_path, tiny_model_dir)
        assert step in (done[-1], done[-1] + 1), (step, lines)
        assert step >= last
        last = step
    print(f"\ncheckpoint kills: {kills} random SIGKILLs, newest checkpoint always loadable "
          f"(reached step {last})")
