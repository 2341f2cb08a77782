"""Learner restarts (issue 7): a checkpoint restores weights and optimizer state exactly
(one rank, and two ranks under ZeRO-3), its folder loads in transformers and in vLLM,
and a run whose learner is SIGKILLed (the launcher restarts it) and then loses its
launcher too (``launch --resume`` by hand) continues the policy version from the last
checkpoint while the actors that kept running reconnect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PY, REPO, SPINE, python_env, run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Runs inside a learner process (one rank, or each rank under torchrun): train, checkpoint,
# train on; or resume from the checkpoint and train the same steps.
_TRAINER = r"""
import sys
from pathlib import Path
import numpy as np
from arpo_async.core.config import SPINE_CONFIG as SPINE, load_config
from learner import loop as M
from learner.dist import init_distributed
from learner.batching import LeafSample, balanced_split

mode, run_dir, model, zero = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
init_distributed()
import torch.distributed as dist
rank, world = dist.get_rank(), dist.get_world_size()
cfg = load_config(SPINE, [f"run.dir={run_dir}", f"model.path={model}", f"learner.zero_stage={zero}",
                         f"learner.world_size={world}", "learner.lr=0.01"])
from learner.trainer import PolicyTrainer
trainer = PolicyTrainer(cfg, model)

def step(seed):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(4):
        n = 12
        samples.append(LeafSample(rng.integers(1, 500, 5).astype(np.int32),
                                  rng.integers(1, 500, n).astype(np.int32), np.ones(n, np.float32),
                                  (-3 * rng.random(n)).astype(np.float32),
                                  rng.standard_normal(n).astype(np.float32), np.zeros(n, np.int32)))
    trainer.train_step(balanced_split(samples, world)[rank])

out = {}
if mode == "save":
    step(1); step(2)
    out = {"at_save/" + k: v for k, v in trainer.full_state().items()}
    M.write_checkpoint(cfg, trainer, rank, world, 2,
                  {"step": 2, "policy_version": 2, "world_size": world, "zero_stage": int(zero)})
elif mode == "resume":
    assert M.resume_point(cfg, trainer, rank, world, run_dir)["step"] == 2
else:  # weights only: what a resume without the optimizer state would give
    from arpo_async.core.rundir import latest_checkpoint
    trainer.engine.load_checkpoint(str(latest_checkpoint(run_dir)), tag="deepspeed",
                                   load_optimizer_states=False)
step(3); step(4)
out |= {"after/" + k: v for k, v in trainer.full_state().items()}
if rank == 0:
    np.savez(run_dir / f"{mode}.npz", **out)
"""


def _trainer(mode: str, run_dir: Path, model: Path, zero: int, world: int) -> dict:
    res = run_ranks(_TRAINER, [mode, str(run_dir), str(model), str(zero)], world, 300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[:3000] + res.stderr[-4000:]
    return dict(np.load(run_dir / f"{mode}.npz"))


@pytest.mark.parametrize("world, zero", [(1, 0), (2, 3)])
def test_checkpoint_restores_weights_and_optimizer_exactly(tiny_model_dir, tmp_path, world,
                                                           zero):
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_async.core.rundir import latest_checkpoint

    saved = _trainer("save", tmp_path, tiny_model_dir, zero, world)
    resumed = _trainer("resume", tmp_path, tiny_model_dir, zero, world)
    names = [k[len("after/"):] for k in saved if k.startswith("after/")]
    assert names
    for name in names:  # steps 3 and 4 after the resume equal steps 3 and 4 without one
        np.testing.assert_allclose(resumed[f"after/{name}"], saved[f"after/{name}"],
                                   rtol=0, atol=1e-7, err_msg=name)
    # the HF folder holds the gathered weights of step 2
    model = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path), dtype=torch.float32)
    params = dict(model.named_parameters())
    for name in names:
        np.testing.assert_array_equal(params[name].detach().numpy(), saved[f"at_save/{name}"])
    if world == 1:  # the optimizer state matters: without it the same steps end elsewhere
        fresh = _trainer("weights_only", tmp_path, tiny_model_dir, zero, world)
        diff = max(float(np.abs(fresh[f"after/{n}"] - saved[f"after/{n}"]).max()) for n in names)
        assert diff > 1e-4, diff


async def test_vllm_loads_a_checkpoint_folder(tiny_model_dir, tmp_path):
    """A checkpoint folder is a model folder vLLM serves with the learner's numbers."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engines.vllm_engine import VLLMEngine
    from learner import checkpoint as C

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    state = {k: v.detach() + 0.02 * torch.randn(v.shape, generator=gen)
             for k, v in model.named_parameters()}
    ckpt = C.write_checkpoint(tmp_path, 5, lambda d: C.export_hf(d, state, tiny_model_dir),
                              {"step": 5}, keep=1)
    prompt, tokens = list(range(3, 15)), list(range(40, 52))
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens])
        logp = torch.log_softmax(trained(ids).logits[0, :-1].float(), -1)
        expected = logp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None])[:, 0].numpy()
    engine = await VLLMEngine.create(str(ckpt), dtype="float32", max_model_len=128,
                                     kv_cache_gib=0.25, seed=0)
    try:
        got = await engine.sequence_logprobs(prompt, tokens)
    finally:
        await engine.close()
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=0)


# ----------------------------------------------------------------------------- a real run


def _launch(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "arpo_async.launch", "--quiet", "--config", SPINE, *args],
                            cwd=REPO, env=python_env(), stdout=log.open("a"),
                            stderr=subprocess.STDOUT)


def _rows(run_dir: Path) -> list[dict]:
    from arpo_async.core.metrics import read_metrics

    return read_metrics(run_dir)


def _wait(what: str, cond, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        tail = log.read_text()[-3000:]
        assert proc.poll() is None, f"launcher exited waiting for {what}:\n{tail}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_killed_learner_resumes_from_its_checkpoint_and_actors_reconnect(tiny_model_dir,
                                                                        tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.out"
    steps = 10

    def last() -> int:
        rows = _rows(run_dir)
        return rows[-1]["step"] if rows else 0

    first = _launch(f"run.dir={run_dir}", f"model.path={tiny_model_dir}", "actors.num=2",
                    "actors.engine=transformers", f"learner.max_steps={steps}",
                    "learner.checkpoint_every=2", "learner.max_restarts=1",
                    "actors.restart_backoff_s=0.5", "rollout.mode=grpo", "rollout.group_size=4",
                    "learner.loss.entropy_coef=0.01", log=log)
    try:
        # 1: the learner dies; the launcher restarts it from its newest checkpoint
        _wait("step 3", lambda: last() >= 3, first, log, 300)
        pids = json.loads((run_dir / "processes.json").read_text())
        os.killpg(pids["learner"], signal.SIGKILL)
        kill1 = len(_rows(run_dir))
        _wait("step 6 after the restart", lambda: len(_rows(run_dir)) > kill1 and last() >= 6,
              first, log, 300)
        # 2: the launcher and the learner die; the actors keep running
        later = json.loads((run_dir / "processes.json").read_text())
        first.kill()
        first.wait()
        os.killpg(later["learner"], signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
    kill2 = len(_rows(run_dir))
    time.sleep(1.0)
    assert all(Path(f"/proc/{later[a]}").exists() for a in ("actor0", "actor1"))
    second = _launch("--resume", str(run_dir), log=log)
    assert second.wait(300) == 0, log.read_text()[-4000:]

    rows = _rows(run_dir)
    seq = [r["step"] for r in rows]
    from learner.checkpoint import complete_checkpoints

    # the policy version goes on from the newest checkpoint before each kill
    ckpt1 = max(s for s in seq[:kill1] if s % 2 == 0)
    ckpt2 = max(s for s in seq[:kill2] if s % 2 == 0)
    assert seq == list(range(1, kill1 + 1)) + list(range(ckpt1 + 1, seq[kill2 - 1] + 1)) \
        + list(range(ckpt2 + 1, steps + 1)), seq
    assert all(r["policy_version"] == r["step"] for r in rows)
    assert [r["learner_restarts"] for r in rows] == [0] * kill1 + [1] * (kill2 - kill1) \
        + [2] * (len(rows) - kill2)
    assert rows[-1]["wall_time"] > rows[kill2 - 1]["wall_time"]  # wall time continues too
    final = complete_checkpoints(run_dir)[-1]
    assert final.name == f"step-{steps:08d}"
    meta = json.loads((final / "trainer_state.json").read_text())
    assert meta["step"] == meta["policy_version"] == steps and meta["learner_restarts"] == 2
    assert set(meta["data_position"]) == {"0", "1"} and min(meta["data_position"].values()) > 0
    assert sum(led["trained"] for led in meta["ledger"].values()) == 2 * steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == steps
    assert summary["adopted"] == ["actor0", "actor1"]
    assert summary["restarts"] == {"learner": 0, "actor0": 0, "actor1": 0}
    events = [(e["event"], e["role"]) for e in map(json.loads, (
        run_dir / "events.jsonl").read_text().splitlines())]
    assert events.count(("restart", "learner")) == 1 and events.count(("adopt", "actor0")) == 1
    assert ("restart", "actor0") not in events and ("restart", "actor1") not in events
    ledger = summary["ledger"]
    for actor, led in ledger.items():  # the same actor processes from start to end
        assert led["incarnations"] == 1, (actor, led)
        assert led["received"] == led["trained"] + sum(led["dropped"].values())
        assert led["sent"] == led["received"] + led["lost"]
        assert led["lost"] <= 4, led  # at most what the dead learner's queue held
    assert sum(led["trained"] for led in ledger.values()) == 2 * steps
    assert any(led["dropped"].get("rolled_back", 0) for led in ledger.values())
    actor_log = (run_dir / "logs" / "actor0.log").read_text()
    assert "said hello again" in actor_log
    # prompts (learner/ledger.py PromptRecord): those rolled back, held by the dead
    # learners or lost on the way to them were drawn again by the actors (the restored
    # learners' Hello replies said which): none skipped, none trained twice
    for actor, led in ledger.items():
        assert led["prompts"]["skipped"] == 0, (actor, led)
        assert led["prompts"]["duplicates"] == led["dropped"].get("duplicate", 0), led
    redone = [line for a in (0, 1)
              for line in (run_dir / "logs" / f"actor{a}.log").read_text().splitlines()
              if "drawing them again" in line]
    assert redone, "no actor drew a prompt again"
    print(f"\nresume: learner killed after {kill1} rows (resumed at {ckpt1}), launcher+learner "
          f"killed after {kill2} rows (resumed at {ckpt2}); ledger {json.dumps(ledger)}")
