"""A checkpoint writer that SIGKILLs itself at a chosen point of a write, for
tests/integration/test_faults_checkpoint.py (run by path in a subprocess, with the
repository root on PYTHONPATH):

    python tests/integration/faults_crash_writer.py RUN_DIR MODEL_DIR CRASH_AT FIRST

It writes checkpoints ``FIRST, FIRST + 1, ...`` with ``learner.checkpoint.write_checkpoint``
(keep=2): HF weights equal to the model's plus the step, and a 24 MB ``optimizer.bin``.
Steps FIRST and FIRST + 1 complete; during the next one it dies at CRASH_AT:
``after_weights``, ``after_optimizer``, ``before_replace:<name>`` or
``after_replace:<name>`` (around the ``os.replace`` that renames to ``<name>``). CRASH_AT
``none`` writes FIRST only and exits 0; anything else that never matches (``never``)
writes until killed from outside. It prints ``begin N`` and ``done N`` around each step
and ``dying POINT N`` just before the SIGKILL."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from learner import checkpoint as C

OPTIMIZER_FLOATS = 6_000_000  # 24 MB of float32


def main(argv: list[str]) -> None:
    run_dir, model_dir = Path(argv[0]), Path(argv[1])
    crash_at, first = argv[2], int(argv[3])
    base = load_file(str(model_dir / "model.safetensors"))
    optimizer = np.random.default_rng(0).standard_normal(OPTIMIZER_FLOATS).astype(np.float32)
    step = first

    def die(point: str) -> None:  # steps first and first + 1 complete, the next one dies
        if point == crash_at and step >= first + 2:
            print("dying", point, step, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    real_replace = os.replace

    def replace(src, dst):
        die(f"before_replace:{Path(dst).name}")
        real_replace(src, dst)
        die(f"after_replace:{Path(dst).name}")

    os.replace = replace  # learner/checkpoint.py and arpo_async/core/files.py call os.replace

    def write(folder: Path) -> None:
        C.export_hf(folder, {k: torch.from_numpy(v + step) for k, v in base.items()},
                    model_dir)
        die("after_weights")
        (folder / "optimizer.bin").write_bytes(optimizer.tobytes())
        die("after_optimizer")

    while True:
        print("begin", step, flush=True)
        C.write_checkpoint(run_dir, step, write, {"step": step, "policy_version": step}, keep=2)
        print("done", step, flush=True)
        if crash_at == "none" and step >= first:
            break
        step += 1


if __name__ == "__main__":
    main(sys.argv[1:])
