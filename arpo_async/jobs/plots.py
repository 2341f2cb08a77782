"""PNG plots of a run from its ``metrics.jsonl``: reward and training accuracy against
wall time and against learner steps (``RUN_DIR/plots/``). Written at the end of a run;
``python -m arpo_async.jobs.plots RUN_DIR`` redraws them for any run folder."""

from __future__ import annotations

import sys
from pathlib import Path

from arpo_async.core.metrics import read_metrics

# (metrics key, label): accuracy is the mean task score of the trained trajectories.
CURVES = (("reward_mean", "reward"), ("score_mean", "accuracy"))


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def write_plots(run_dir: str | Path, window: int = 5) -> list[Path]:
    """Draw ``by_wall_time.png`` and ``by_step.png``; the files written ([] with no rows)."""
    import matplotlib  # matplotlib: heavy; its backend is set before pyplot loads

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        return []
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for xkey, xlabel, name in (("wall_time", "wall time of the RL stage (s)", "by_wall_time"),
                               ("step", "learner step", "by_step")):
        fig, axes = plt.subplots(1, len(CURVES), figsize=(10, 3.6))
        xs = [r[xkey] for r in rows]
        for ax, (key, label) in zip(axes, CURVES):
            ys = [float(r.get(key, 0.0)) for r in rows]
            ax.plot(xs, ys, ".", alpha=0.35, label="per step")
            ax.plot(xs, _smooth(ys, window), "-", label=f"mean of {window}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(loc="lower right", fontsize=8)
        fig.suptitle(f"{run_dir.name}: {label_of(rows)}")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def label_of(rows: list[dict]) -> str:
    return f"{rows[-1]['step']} steps, {rows[-1]['wall_time']:.0f} s"


if __name__ == "__main__":
    for p in write_plots(sys.argv[1]):
        print(p)
