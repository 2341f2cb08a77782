"""Every paper preset in configs/presets validates, passes ``launch --dry-run`` on a CPU
machine, carries the published numbers it claims, and says where they come from."""

from __future__ import annotations

import subprocess

import pytest

from arpo_async.core.config import load_config
from arpo_async.launcher.plan import check_placement, plan
from tests.conftest import PY, REPO, python_env

PRESETS = sorted((REPO / "configs" / "presets").glob("*.yaml"))
NAMES = [p.name for p in PRESETS]

# The published settings (ARPO arXiv 2507.19849 as restated in issue 8; AEPO 2510.14545).
PAPER = {
    "arpo_reasoning_qwen2.5_7b.yaml": dict(model="Qwen2.5-7B", M=16, N=8, T=3, response=4096),
    "aepo_reasoning_qwen2.5_7b.yaml": dict(model="Qwen2.5-7B", M=16, N=8, T=3, response=4096),
    "arpo_deepsearch_qwen3_8b.yaml": dict(model="Qwen3-8B", M=16, N=8, T=6, response=10000),
    "aepo_deepsearch_qwen3_8b.yaml": dict(model="Qwen3-8B", M=16, N=8, T=6, response=10000),
    "arpo_deepsearch_qwen3_14b.yaml": dict(model="Qwen3-14B", M=12, N=6, T=6, response=6192),
    "two_node_qwen3_14b.yaml": dict(model="Qwen3-14B", M=12, N=6, T=6, response=6192),
}


def test_every_preset_is_listed_here():
    assert set(NAMES) == set(PAPER) and len(NAMES) >= 6


@pytest.mark.parametrize("name", NAMES)
def test_preset_carries_the_published_settings(name):
    cfg = load_config(REPO / "configs" / "presets" / name)
    want = PAPER[name]
    assert want["model"] in cfg.model.path
    ro, s, ln = cfg.rollout, cfg.sampling, cfg.learner
    assert (ro.group_size, ro.initial_samples, ro.tool_call_limit) == (want["M"], want["N"],
                                                                      want["T"])
    assert (s.max_prompt_tokens, s.max_response_tokens) == (1536, want["response"])
    assert cfg.model.max_model_len >= s.max_prompt_tokens + s.max_response_tokens
    assert (s.temperature, s.top_p, ln.lr, ln.loss.kl_coef, ln.loss.entropy_coef) == (
        1.0, 1.0, 1e-6, 0.0, 0.0)
    assert (ro.alpha, ro.beta, ro.branch_factor, ro.entropy_window) == (0.5, 0.2, 1, 20)
    # the authors' round entropy (vllm_rollout_with_tools.py): top-10 known terms summed
    # over the window, short rounds as they are, a fork's own first round as its H_init,
    # rounds bounded by the budget alone
    assert (ro.entropy_estimator, ro.entropy_reduce, s.logprobs_topk) == ("reference", "sum", 10)
    assert (ro.short_round, ro.fork_h_init, s.round_max_tokens) == ("as_is", "own", None)
    # one fresh global sample per round while none is live (the fill loop of the same file)
    assert ro.fill == "one_per_round"
    # batch 128 prompts, mini-batch 16: eight optimizer steps per rollout batch of 128
    # groups, one epoch, the proximal policy kept from before the first step
    assert (ln.batch_groups, ln.minibatches, ln.ppo_epochs) == (128, 8, 1)
    assert ln.loss.proximal == "recompute"
    assert (ln.loss.eps_low, ln.loss.eps_high, ln.loss.dual_clip) == (0.2, 0.2, 3.0)
    assert cfg.model.dtype == "bfloat16" and cfg.cluster.device == "cuda"
    assert not cfg.model.build_if_missing  # never a random tiny model in place of Qwen
    aepo = name.startswith("aepo")
    assert ro.mode == ("aepo" if aepo else "arpo")
    assert getattr(ro, "aepo_rule", None) == ("authors" if aepo else None)  # aepo mode's key
    assert (ln.loss.aepo_entropy_clip, ln.loss.aepo_entropy_adv_gamma) == (
        (True, 0.2) if aepo else (False, 0.0))


@pytest.mark.parametrize("name", NAMES)
def test_preset_states_where_its_numbers_come_from(name):
    text = (REPO / "configs" / "presets" / name).read_text()
    assert "2507.19849" in text or "arpo_deepsearch_qwen3_14b.yaml" in text
    if name.startswith("aepo"):
        assert "2510.14545" in text
    assert "--dry-run" in text  # how to check it


@pytest.mark.parametrize("name", NAMES)
def test_preset_plan_places_every_gpu_once(name, monkeypatch):
    monkeypatch.chdir(REPO)  # presets name repo-relative files (DeepSpeed JSON, hostfile)
    cfg = load_config(REPO / "configs" / "presets" / name)
    roles = plan(cfg, "runs/x/config.yaml")
    check_placement(cfg)
    local_gpus = [g for r in roles if r.local and r.kind == "actor"
                  for g in r.env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert len(local_gpus) == len(set(local_gpus)) == cfg.actors.num * cfg.actors.gpus_per_actor
    assert not set(map(int, local_gpus)) & set(cfg.cluster.learner_gpus)


@pytest.mark.parametrize("name", NAMES)
def test_preset_passes_dry_run_on_cpu(name, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run([PY, "-m", "arpo_async.launch", "--config",
                          f"configs/presets/{name}", "--dry-run", f"run.dir={run_dir}"],
                         cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert out.startswith(f"config OK: configs/presets/{name}")
    cfg = load_config(REPO / "configs" / "presets" / name)
    assert "learner (started here" in out
    for i in range(cfg.actors.num):
        assert f"actor{i} (started here; cuda:" in out
    assert f"--config {run_dir}/config.yaml" in out
    assert not run_dir.exists()  # a dry run starts and writes nothing


# ----------------------------------------------------------------------------- the doc

DOC = REPO / "docs" / "scale-out.md"


def _code_blocks(text: str) -> list[str]:
    parts = text.split("```")
    return [parts[i].split("\n", 1)[1] for i in range(1, len(parts), 2)]


def test_scale_out_doc_shows_the_plan_the_code_prints():
    blocks = _code_blocks(DOC.read_text())
    res = subprocess.run([PY, "-m", "arpo_async.launch", "--config",
                          "configs/presets/two_node_qwen3_14b.yaml", "--dry-run"],
                         cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    printed = res.stdout.replace(PY, "python").strip()
    assert printed in [b.strip() for b in blocks], "docs/scale-out.md shows a stale plan"


def test_scale_out_doc_commands_parse_with_the_real_parsers(monkeypatch):
    import shlex

    monkeypatch.chdir(REPO)  # the preset names its hostfile relative to the repo

    from arpo_async.launch import _parser as launch_parser
    from arpo_async.launcher.remote import HOST_LOCAL_KEYS
    from arpo_async.launcher.remote import _parser as actor_parser

    text = DOC.read_text()
    commands = [line for block in _code_blocks(text) for line in block.splitlines()
                if "python -m arpo_async.launch" in line and not line.startswith("  ")]
    assert len(commands) >= 6
    cfg = load_config(REPO / "configs" / "presets" / "two_node_qwen3_14b.yaml")
    planned = {r.command() for r in plan(cfg, "runs/x/config.yaml") if not r.local}
    actor_lines = 0
    for line in commands:
        words = shlex.split(line)
        while "=" in words[0]:
            words.pop(0)
        assert words[:3] == ["python", "-m", "arpo_async.launch"], line
        if words[3:4] == ["actor"]:
            actor_parser().parse_args(words[4:])
            assert line in planned, line  # exactly what the plan prints
            actor_lines += 1
        else:
            launch_parser().parse_args(words[3:])
    assert actor_lines == len(planned) == 4
    for key in HOST_LOCAL_KEYS:  # the doc lists the keys a remote actor may change
        assert f"`{key}`" in text, key
