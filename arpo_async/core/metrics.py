"""Metrics: one JSON object per learner step in ``metrics.jsonl`` (appended, flushed, so a
resumed run continues the same file), mirrored to TensorBoard and, with ``metrics.wandb``,
to Weights & Biases; plus the fixed probe sequence that actors and learner both score to
check they hold the same weights.

W&B: one run per run folder. Its id is kept in ``RUN_DIR/wandb_id``, so a restarted or
resumed learner, and the pipeline logging the plots at the end, continue the same run.
Without an API key (and without ``WANDB_MODE``) it runs offline into ``RUN_DIR/wandb``
(``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later)."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from arpo_async.core.files import read_jsonl_appended


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + "/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:  # only the last byte: the file grows all run long
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def wandb_run(run_dir: str | Path, settings: Any, config: dict | None = None) -> Any:
    """Start (or continue) the W&B run of ``run_dir``; ``settings``: ``cfg.metrics``."""
    import wandb  # wandb: an optional extra (metrics.wandb)

    run_dir = Path(run_dir)
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    mode = settings.wandb_mode
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(project=settings.wandb_project, entity=settings.wandb_entity or None,
                      name=settings.wandb_name or run_dir.resolve().name, id=run_id,
                      resume="allow", dir=str(run_dir), mode=mode, config=config)


class MetricsWriter:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: Any = None,
                 config: dict | None = None):
        """``wandb``: ``cfg.metrics`` with ``wandb`` true to log there too (with
        ``config``, the resolved config), or None."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        if self._file.tell() and not _ends_with_newline(self.path):
            self._file.write("\n")  # a killed writer's half line stays alone (it is skipped)
        self._tb = None
        if tensorboard:
            try:
                # torch: heavy, and the launcher imports this module
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception:  # tensorboard is optional at run time
                self._tb = None
        self._wandb = (wandb_run(run_dir, wandb, config)
                       if wandb is not None and wandb.wandb else None)

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self._file.write(json.dumps(record, default=_json_default) + "\n")
        if self._tb is not None and "step" in record:
            for k, v in flatten(record).items():
                if k not in ("step", "time") and math.isfinite(v):
                    self._tb.add_scalar(k, v, int(record["step"]))
        if self._wandb is not None and "step" in record:
            self._wandb.log({k: v for k, v in flatten(record).items()
                             if k not in ("step", "time") and math.isfinite(v)},
                            step=int(record["step"]))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_log_images(run_dir: str | Path, settings: Any, images: list[Path]) -> None:
    """Add PNG files (the run's plots) to the run folder's W&B run, when there is one."""
    if not settings.wandb or not images:
        return
    import wandb

    run = wandb_run(run_dir, settings)
    run.log({Path(p).stem: wandb.Image(str(p)) for p in images})
    run.finish()


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl_appended(Path(run_dir) / "metrics.jsonl")  # the learner appends


def probe_sequence(vocab_size: int, length: int = 24) -> tuple[list[int], list[int]]:
    """A fixed (prompt, continuation) pair of token ids inside any vocabulary."""
    ids = [(7 + 31 * i) % max(vocab_size - 1, 1) + 1 for i in range(length)]
    return ids[: length // 2], ids[length // 2:]


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with Path(path).open("a") as f:
        f.write(json.dumps(record, default=_json_default) + "\n")


def variance_summary(rows: list[dict]) -> dict:
    """A run's share of trained groups with non-zero reward variance, from its metrics
    rows (learner/rollout_metrics.py ``variance_metrics``): over the run, in its first and
    last tenth of steps, and per task kind; None for a run whose rows do not have it."""
    def share(part: list[dict]) -> float | None:
        n = sum(r.get("groups", 0) for r in part)
        varied = sum(r.get("groups/nonzero_var", 0.0) for r in part)
        return round(varied / n, 4) if n and any("groups/nonzero_var" in r for r in part) \
            else None

    tenth = max(1, len(rows) // 10)
    kinds: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("groups/kind/"):
                kind, _, what = key.removeprefix("groups/kind/").rpartition("/")
                sums = kinds.setdefault(kind, [0.0, 0.0])
                sums[what == "nonzero_var"] += float(value)
    return {"share": share(rows), "first_tenth": share(rows[:tenth]),
            "last_tenth": share(rows[-tenth:]),
            "by_kind": {k: round(v / n, 4) for k, (n, v) in sorted(kinds.items()) if n}}
