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
(``arpo_async.tasks.saved_position``): prompts in flight when it died are drawn again,
none is skipped. Actors that outlive a learner restart keep their own position.

No deepspeed here: the trainer writes its engine state into the folder this module
prepares (``PolicyTrainer.save_checkpoint``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("learner.checkpoint")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "trainer_state.json"
RUN_STATE = "state.json"  # RUN_DIR/state.json: the learner's view after every step
_NAME = re.compile(r"^step-(\d{8})$")
_PARTIAL = ".partial-"
# Files of model.path that are weights (replaced by ours) rather than config/tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


# ----------------------------------------------------------------------------- durable files


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list is what makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> int:
    """fsync every file and folder under ``root`` (deepest first); returns files synced."""
    count = 0
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder) / name)
            count += 1
        fsync_path(Path(folder))
    return count


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temporary file, fsync, rename, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: str | Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable (logged)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s); ignoring it", path, exc)
        return None
    if not isinstance(obj, dict):
        log.warning("%s does not hold a JSON object; ignoring it", path)
        return None
    return obj


# ----------------------------------------------------------------------------- layout


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint folder is complete when its metadata (written last) parses."""
    return _NAME.match(path.name) is not None and read_json(path / META) is not None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and is_complete(p)),
                  key=lambda p: p.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None.

    ``latest`` names it too; after a crash between the folder's rename and the pointer
    update the pointer is one behind, which is logged (the folder is complete either way:
    its metadata is written and fsynced before the rename)."""
    found = complete_checkpoints(run_dir)
    newest = found[-1] if found else None
    try:
        name = (checkpoints_dir(run_dir) / LATEST).read_text().strip()
    except OSError:
        name = ""
    if newest is not None and name != newest.name:
        log.warning("checkpoint pointer %s names %r; the newest complete checkpoint is %s",
                    checkpoints_dir(run_dir) / LATEST, name, newest.name)
    return newest


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
    for old in root.glob(f"{_PARTIAL}*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = root / f"{_PARTIAL}{checkpoint_name(step)}"
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
        doomed = root / f"{_PARTIAL}old-{final.name}"
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
    import safetensors.torch

    src = Path(model_path)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) \
                and item.name not in _WEIGHT_INDEXES:
            shutil.copy2(item, dest / item.name)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    safetensors.torch.save_file(tensors, str(dest / "model.safetensors"),
                                metadata={"format": "pt"})


def tensors_from_numpy(state: dict, bf16: bool) -> dict:
    """numpy arrays from ``PolicyTrainer.full_state`` -> torch tensors (bfloat16 arrays
    travel as their uint16 bits)."""
    import torch

    out = {}
    for name, arr in state.items():
        t = torch.from_numpy(arr)
        out[name] = t.view(torch.bfloat16) if bf16 else t
    return out
