"""The default job (configs/default.yaml) end to end with small budgets and real parts:
synthetic suite built with the sandboxed Python tool and the BM25 index, SFT, evaluation
with a live retriever, the async RL stage (DeepSpeed learner, vLLM actor over ZeroMQ),
evaluation of the RL checkpoint, summary and plots; then a resume that reruns only the
stage that is missing. The evaluations run on the transformers engine
(``pipeline.eval_engine``: 15 s less per stage); vLLM evaluation with the live retriever
is test_sft_eval.py's and test_real_tokenizer_chain.py's.

The model stage builds the tiny model with a tokenizer like a real one
(``model.tiny_tags_as_text``: no ARPO tag is a token, tags merge with their neighbours),
so this is also the acceptance run of issue 16: stop strings, results after partial tags,
SFT masks and evaluation parsing on multi-token tags, with tools used after SFT. The
single-token tag path runs end to end in test_spine.py and test_sft_eval.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PY, REPO, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HELDOUT = 12
SMALL = ["pipeline.suite_entities=60", "pipeline.suite_sft=48", "pipeline.suite_rl=40",
         f"pipeline.suite_heldout={HELDOUT}", "pipeline.sft_time_s=0",
         # with tags as text (several tokens each), 60 steps of 16 traces gave 0.07 tool
         # calls per held-out sample (k=8), 120 steps 0.96; 120 steps of 8 traces (half
         # the SFT time) 0.5 at k=1: tool use after SFT, not by luck
         "pipeline.sft_steps=120", "pipeline.sft_batch_size=8",
         "pipeline.eval_k=1", "pipeline.eval_limit=0", "pipeline.eval_engine=transformers",
         "actors.num=1", "learner.max_steps=3",
         "run.time_limit_s=0", "learner.checkpoint_every=2", "learner.batch_groups=1",
         "rollout.group_size=4", "rollout.initial_samples=2", "sampling.max_response_tokens=160",
         # every trace uses its tools: a short SFT on the default's 40% answering from memory
         # teach only that, and this test checks the tool path end to end
         "pipeline.suite_direct=0",
         # W&B beside TensorBoard, offline (no API key here): steps, config, plots
         "metrics.wandb=true"]


def _launch(*args: str, timeout: float = 540) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "arpo_async.launch", "--quiet", *args], cwd=REPO,
                          env=python_env() | {"WANDB_MODE": "offline"}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    run_dir, data = root / "run", root / "data"
    res = _launch(f"run.dir={run_dir}", f"model.path={root}/model", "model.tiny_tags_as_text=true",
                  f"pipeline.data_dir={data}", f"task.data={data}/rl.jsonl", *SMALL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return run_dir, data, res.stdout


def test_default_job_runs_every_stage(finished_run):
    run_dir, data, out = finished_run
    state = json.loads((run_dir / "pipeline.json").read_text())
    assert list(state["stages"]) == ["data", "model", "sft", "eval_sft", "rl", "eval_rl"]
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("accuracy_after_sft", "accuracy_after_rl"):
        assert 0.0 <= summary[key] <= 1.0, summary
    assert summary["heldout_size"] == HELDOUT and summary["status"] == "ok"
    # the model stage built a tokenizer without tag tokens, and SFT taught it the tools
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(state["stages"]["model"]["path"])
    assert len(tok.encode("</python>", add_special_tokens=False)) > 1
    assert summary["tool_calls_per_sample_after_sft"] > 0, summary
    assert summary["wall_time_s"] > 0 and summary["steps"] == 3
    # the default job keeps requests on their KV cache across weight updates
    # (actors.update_mode=auto: keep on vLLM): the engines sampled tokens and never
    # prefilled a context again
    prefill = summary["tokens"]["prefill"]
    assert prefill["sampled_tokens"] > 0 and prefill["recomputed_tokens"] == 0, prefill
    assert summary["rl"]["steps"] == 3 and summary["rl"]["checkpoint"].endswith("step-00000003")
    # the held-out prompts were answered with tools, against the live retriever
    tools = state["stages"]["eval_rl"]["tools"]
    assert tools["calls"] > 0 and tools["errors"] < tools["calls"], tools
    items = [json.loads(x) for x in (run_dir / "eval" / "rl" / "items.jsonl").open()]
    assert len(items) == HELDOUT and {i["kind"] for i in items} == {"arith", "lookup", "combo"}
    calls = sum(sum(i["tool_calls"]) for i in items)
    assert summary["tool_calls_per_sample"] == pytest.approx(  # rounded to 3 places
        calls / (HELDOUT * summary["eval_k"]), abs=1e-3)
    for name in ("by_wall_time.png", "by_step.png"):
        assert (run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out accuracy" in out and "after RL" in out
    # the gain's prompt-paired standard error, and the RESULT line that names the model
    assert summary["gain_se"] >= 0 and summary["model_name"]
    assert any(line.startswith(f"RESULT {summary['model_name']} sft=") and
               line.endswith(("met", "missed")) for line in out.splitlines()), out[-2000:]
    # ARPO's branch decisions are visible on every RL step and in the summary
    from arpo_async.core.metrics import read_metrics
    from learner.rollout_metrics import KEYS

    rows = read_metrics(run_dir)
    assert rows and all(set(KEYS) <= set(r) for r in rows), rows[-1]
    # step 1 trains on version-0 tokens with version-0 weights and proximal=bypass, so
    # r = exp(learner log-prob - actor log-prob): the ids the learner trains on are the
    # ones the behaviour log-probs belong to (a shift by one token gives r far from 1)
    assert rows[0]["loss/ratio_max"] < 1.001 and rows[0]["loss/approx_kl"] < 1e-5, rows[0]
    assert summary["rl"]["branch_decisions"] == sum(r["branch/decisions"] for r in rows)
    assert 0.0 <= summary["rl"]["fork_rate"] <= 1.0
    assert 0.0 <= summary["rl"]["p_outside_band_share"] <= 1.0
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert runs and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one run id
    plots = [p.name for r in runs for p in (r / "files" / "media").rglob("*.png")]
    assert any(p.startswith("by_wall_time") for p in plots), plots
    assert len((data / "heldout.jsonl").read_text().splitlines()) == HELDOUT


def test_rl_checkpoint_loads_in_transformers(finished_run):
    from transformers import AutoModelForCausalLM

    run_dir, _, _ = finished_run
    ckpt = json.loads((run_dir / "summary.json").read_text())["rl"]["checkpoint"]
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.model_type == "qwen3"


def test_resume_reruns_only_missing_stages(finished_run):
    run_dir, _, _ = finished_run
    path = run_dir / "pipeline.json"
    state = json.loads(path.read_text())
    before = state["stages"].pop("eval_rl")
    path.write_text(json.dumps(state))
    res = _launch("--resume", str(run_dir))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for stage in ("data", "model", "sft", "eval_sft", "rl"):
        assert f"{stage}: done before" in res.stdout
    assert "eval_rl: starting" in res.stdout
    after = json.loads(path.read_text())["stages"]["eval_rl"]
    assert after["n"] == before["n"] == HELDOUT


def test_a_used_run_folder_is_refused(finished_run):
    run_dir, _, _ = finished_run
    res = _launch(f"run.dir={run_dir}", timeout=60)
    assert res.returncode == 2 and "already holds a run" in res.stderr and "--resume" in res.stderr
