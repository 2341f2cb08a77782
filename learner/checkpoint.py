"""Durable checkpoints and run state: atomic writes, the checkpoint folder layout, the
``latest`` pointer, retention, and loading the newest complete checkpoint.

Layout (``RUN_DIR/checkpoints/``)::

    step-00000010/            a Hugging Face model folder, loadable by transformers and vLLM:
      model.safetensors       full weights (gathered under ZeRO-3), in model.dtype
      config.json, tokenizer* every non-weight file copied from model.path
      deepspeed/              DeepSpeed's own save_checkpoint: fp32 weights + optimizer state
      trainer_state.json      step, policy version, counters, data position (written last)
    latest                    the name of the newest complete checkpoint (one line)

Why a crash never leaves a broken checkpoint behind: everything is written into a
``.partial-step-...`` folder, every file and folder in it is fsynced, then the folder is
renamed into place (atomic on one filesystem) and the parent folder fsynced; only then
is ``latest`` replaced (temporary file + fsync + rename + fsync). A SIGKILL at any point
leaves the previous checkpoint, or the new one complete. Loading takes the newest
complete ``step-*`` folder (complete: its metadata, written last, parses). Leftover
``.partial-*`` folders are removed by the next write.

``RUN_DIR/state.json`` (the run state, rewritten atomically after every learner step)
holds what ``trainer_state.json`` holds, for the newest step: policy version, per-actor
ledger and data positions. A resumed learner takes weights and optimizer from the
checkpoint and the ledger from both (groups trained after the checkpoint are counted as
"rolled_back"). Data position: each actor draws prompts from its own seeded
permutation stream; it reports the earliest stream position it has not yet delivered,
the learner records it here, and a (re)started actor continues from it
(``toolenv.tasks.prompts.saved_position``): prompts in flight when it died are drawn again,
none is skipped. Actors that outlive a learner restart keep their own position.

No deepspeed here: the trainer writes its engine state into the folder this module
prepares (``PolicyTrainer.save_checkpoint``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from arpo_async.core.files import atomic_write_bytes, fsync_path, fsync_tree, read_json
from arpo_async.core.rundir import (
    LATEST,
    META,
    PARTIAL,
    checkpoint_name,
    checkpoints_dir,
    complete_checkpoints,
)

log = logging.getLogger("learner.checkpoint")

# Files of model.path that are weights (replaced by ours) rather than config/tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_meta(ckpt: str | Path) -> dict:
    meta = read_json(Path(ckpt) / META)
    if meta is None:
        raise FileNotFoundError(f"{ckpt}: no readable {META} (incomplete checkpoint)")
    return meta


# ----------------------------------------------------------------------------- writing


def prepare(run_dir: str | Path, step: int) -> Path:
    """A fresh, empty partial folder for the checkpoint of ``step`` (removes leftovers of
    earlier crashed writes). Rank 0 calls it; every rank then writes into the folder."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(f"{PARTIAL}*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = root / f"{PARTIAL}{checkpoint_name(step)}"
    tmp.mkdir()
    return tmp


def commit(run_dir: str | Path, tmp: Path, step: int, meta: dict, keep: int) -> Path:
    """Finish the checkpoint in ``tmp``: metadata, fsync, rename, pointer, retention."""
    root = checkpoints_dir(run_dir)
    final = root / checkpoint_name(step)
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    files = fsync_tree(tmp)
    if final.exists():  # the same step again (a resumed run repeating it): replace it
        doomed = root / f"{PARTIAL}old-{final.name}"
        os.replace(final, doomed)
        fsync_path(root)
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(root)
    atomic_write_bytes(root / LATEST, (final.name + "\n").encode())
    prune(run_dir, keep)
    log.info("checkpoint %s written (%d files)", final, files)
    return final


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    removed = complete_checkpoints(run_dir)[:-keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def write_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], None],
                     meta: dict, keep: int) -> Path:
    """prepare + ``write(folder)`` + commit, for a single writer."""
    tmp = prepare(run_dir, step)
    write(tmp)
    return commit(run_dir, tmp, step, meta, keep)


def export_hf(dest: Path, tensors: dict, model_path: str | Path) -> None:
    """Write ``tensors`` (name -> torch tensor, HF names) as ``model.safetensors`` and copy
    the config and tokenizer files of ``model_path`` next to it."""
    # safetensors.torch, torch: only the weights need them; writers without torch use
    # the rest (tests/integration/faults_crash_writer.py)
    import safetensors.torch

    src = Path(model_path)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) \
                and item.name not in _WEIGHT_INDEXES:
            shutil.copy2(item, dest / item.name)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    safetensors.torch.save_file(tensors, str(dest / "model.safetensors"),
                                metadata={"format": "pt"})
