"""The chaos soak in CI (issue 17): a short real run (DeepSpeed learner, the Python sandbox
pool, the retriever behind its proxy, the launcher, checkpoints and resume) under a fault
every 15 s, and the verdict asserted. ``python -m arpo_async.jobs.experiments chaos`` with a
small suite; the actors run the simulated engine (``actors.engine=simulated``: real
transport, admission, rollout and tools, tokens paced by ``sim.*``), which starts in
seconds and calls the tools on every round, where the untrained tiny model on vLLM seldom
did: the retriever and sandbox faults meet calls in flight. Faults: learner and launcher
kills, a stalled actor, garbage frames, retriever and sandbox kills. A vLLM actor's
SIGKILL and SIGSTOP (half a minute to restart here) are test_faults_processes.py's; the
soak (``jobs.experiments chaos`` without these caps) runs vLLM actors for 30 minutes."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import PY, REPO, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAULTS = "learner_kill,launcher_kill,actor_stop,frames,retriever_kill,sandbox_kill"
SMALL_RUN = ["rollout.mode=grpo", "rollout.group_size=4", "sampling.max_response_tokens=96",
             "learner.batch_groups=2",
             "actors.max_inflight_trajectories=8", "pipeline.suite_entities=40",
             "pipeline.suite_sft=20", "pipeline.suite_rl=200", "pipeline.suite_heldout=10",
             "learner.checkpoint_every=4", "actors.engine=simulated"]


def test_a_short_chaos_run_passes_its_verdict(tiny_model_dir, tmp_path):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    cmd = [PY, "-m", "arpo_async.jobs.experiments", "chaos", "--duration-s", "45",
           "--fault-every-s", "15", "--seed", "7", "--faults", FAULTS, "--sft-steps", "0",
           "--startup-s", "20", "--grace-s", "120", f"run.dir={run_dir}",
           f"model.path={tiny_model_dir}", f"pipeline.data_dir={data}",
           f"task.data={data}/rl.jsonl", *SMALL_RUN]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True,
                         timeout=400)
    wall = time.monotonic() - t0
    out = res.stdout[-4000:] + res.stderr[-3000:]
    verdict = json.loads((run_dir / "chaos_verdict.json").read_text())
    faults = [json.loads(x) for x in (run_dir / "chaos.jsonl").read_text().splitlines()]
    checks = verdict["checks"]
    print(f"\nchaos CI run: {wall:.0f} s, faults {verdict['faults']}, steps "
          f"{checks['finished']['steps']}, gap {checks['longest_gap']['value']}, ledger "
          f"{checks['ledger']['value']}")
    assert res.returncode == 0 and verdict["ok"], out
    assert len(faults) >= 2 and all({"time", "kind", "target"} <= f.keys() for f in faults)
    assert checks["finished"]["steps"] >= 10
    assert checks["checkpoints"]["loaded"] >= 2 and checks["processes_left"]["left"] == []
