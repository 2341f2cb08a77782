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


def pytest_collection_modifyitems(config, items):
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
