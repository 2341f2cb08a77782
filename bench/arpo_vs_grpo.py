"""ARPO against GRPO, from one SFT checkpoint of the default job, same wall-clock budget.

Arms (each a real RL stage: vLLM actors, DeepSpeed learner, sandboxed Python, BM25 search,
then the held-out evaluation of its last checkpoint, exactly as the default job runs them):
- ``grpo``: no branching (``rollout.mode=grpo``);
- ``arpo``: entropy branching with the reference defaults (alpha 0.5, beta 0.2, summed
  window entropy);
- ``random``: ARPO with random branching: ``beta=0`` so P no longer depends on entropy,
  and ``alpha`` set to the decision-weighted mean P of the same seed's ``arpo`` run, so it
  wants a fork as often as ARPO did, at the same decision points (after each tool result),
  but placed by chance. This is the ablation that isolates the entropy signal;
- ``aepo``: AEPO (dynamic budget split, branch penalty).

The budget (``--budget-s``) counts from the end of each run's first learner step
(``run.time_limit_from=first_step``): how long the engines take to start depends on the
shared machine's load and is not training time. Every arm runs once per seed
(``run.seed``: the actors' sampling and branching), in an order rotated per seed so that
slow drift of the shared machine does not favour one arm.
With ``--lock FILE`` each arm holds an exclusive ``flock`` on FILE while it runs, so other
heavy jobs that take the same lock do not share its budget.

Reported per arm (mean and standard error over seeds): held-out pass@1 after RL, executed
tool calls per leaf during RL, tool calls per question at evaluation, fork rate (forks per
branch decision), RL steps done. JSON to ``--results``, a plot next to it, and the last
line ``RESULT arpo_vs_grpo tool_calls_ratio=<arpo/grpo executed tool calls per leaf>
accuracy_delta=<arpo - grpo pass@1> target=... met|missed``.

    python bench/arpo_vs_grpo.py [--run runs/default] [--seeds 0,1,2] [--budget-s 180]
        [--arms grpo,arpo,random,aepo] [--eval-limit 300] [--eval-k 2] [--lock FILE]

Each arm's run folder is kept under ``--out``; run the same command again and the arms
already finished there are read back, not run again (a half-done arm is run again).
``--run`` is a finished default job (``python -m arpo_async.launch``): its
``pipeline_config.yaml``, ``sft/`` model, data folder and SFT evaluation are reused.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, SCRATCH_DIR, write_results  # noqa: E402

ARMS = ("grpo", "arpo", "random", "aepo")


def arm_overrides(arm: str, random_alpha: float | None) -> dict:
    if arm == "grpo":
        return {"rollout.mode": "grpo"}
    if arm == "arpo":
        return {"rollout.mode": "arpo"}
    if arm == "aepo":
        return {"rollout.mode": "aepo"}
    if arm == "random":
        if random_alpha is None:
            raise ValueError("the random arm needs the same seed's arpo run first")
        return {"rollout.mode": "arpo", "rollout.beta": 0.0, "rollout.alpha": random_alpha}
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")


def decision_weighted_p(run_dir: Path) -> float:
    """Mean branch probability over every decision of a run (metrics.jsonl)."""
    from arpo_async.core.metrics import read_metrics

    rows = read_metrics(run_dir)
    n = sum(r.get("branch/decisions", 0) for r in rows)
    if not n:
        raise RuntimeError(f"{run_dir}: no branch decisions recorded; cannot set the random "
                           "arm's rate")
    return sum(r["branch/p_mean"] * r["branch/decisions"] for r in rows) / n


@contextlib.contextmanager
def exclusive(lock: str | None):
    if not lock:
        yield
        return
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_arm(base, arm: str, seed: int, args, sft: str, url: str, out: Path,
            random_alpha: float | None) -> dict:
    from arpo_async.jobs.pipeline import run_eval, run_rl

    cfg = base.model_copy(deep=True)
    run_dir = out / f"{arm}-seed{seed}"
    overrides = {"run.seed": seed, "run.time_limit_s": args.budget_s,
                 "run.time_limit_from": "first_step",  # start-up, load-dependent, not counted
                 "learner.max_steps": 100000, "pipeline.eval_limit": args.eval_limit,
                 "pipeline.eval_k": args.eval_k, "metrics.wandb": False,
                 **arm_overrides(arm, random_alpha)}
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg.run.dir = str(run_dir)
    cfg = type(cfg).model_validate(cfg.model_dump())  # re-check the changed fields
    run_dir.mkdir(parents=True)
    t0 = time.time()
    run_rl(cfg, run_dir, sft, url, quiet=True)
    t_rl = time.time() - t0
    from arpo_async.core.rundir import latest_checkpoint

    run_eval(cfg, str(latest_checkpoint(run_dir)), url, run_dir / "eval")
    timing = {"stage_s": round(t_rl, 1), "eval_s": round(time.time() - t0 - t_rl, 1),
              "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    (run_dir / "bench_timing.json").write_text(json.dumps(timing))
    return row_from_folder(run_dir, arm, seed)


def row_from_folder(run_dir: Path, arm: str, seed: int) -> dict:
    """An arm's figures from its finished run folder (so an interrupted bench resumes)."""
    from arpo_async.core.config import load_config
    from arpo_async.jobs.pipeline import rl_figures

    cfg = load_config(run_dir / "config.yaml", [])
    rl = rl_figures(run_dir)
    ev = json.loads((run_dir / "eval" / "summary.json").read_text())
    timing_path = run_dir / "bench_timing.json"
    row = {"arm": arm, "seed": seed, "accuracy": ev["pass@1"],
           "tool_calls_per_question": ev["tool_calls_per_sample"],
           "no_tool_share": ev.get("no_tool_share"),
           "executed_per_leaf": rl.get("tools_executed_per_leaf_mean"),
           "fork_rate": rl.get("fork_rate"), "p_outside_band_share": rl.get("p_outside_band_share"),
           "p_mean": rl.get("branch_p_mean_mean"), "steps": rl.get("steps"),
           "rl_wall_s": rl.get("rl_wall_s"), "alpha": cfg.rollout.alpha,
           "beta": cfg.rollout.beta, "run_dir": str(run_dir),
           **(json.loads(timing_path.read_text()) if timing_path.is_file() else {})}
    if arm == "arpo":
        row["decision_weighted_p"] = decision_weighted_p(run_dir)
    return row


def finished(run_dir: Path) -> bool:
    return (run_dir / "eval" / "summary.json").is_file()


def mean_se(values: list[float]) -> tuple[float, float]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return m, math.sqrt(var / len(vals))


FIGURES = ("accuracy", "executed_per_leaf", "tool_calls_per_question", "fork_rate",
           "p_outside_band_share", "steps")


def summarize(rows: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if mine:
            out[arm] = {"n": len(mine), **{f: mean_se([r[f] for r in mine]) for f in FIGURES}}
    return out


def plot(summary: dict, sft_acc: float | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (fig_key, label) in zip(axes, [("accuracy", "held-out pass@1 after RL"),
                                           ("executed_per_leaf", "tool calls per leaf (RL)"),
                                           ("fork_rate", "forks per decision")]):
        means = [summary[a][fig_key][0] for a in arms]
        errs = [0 if math.isnan(summary[a][fig_key][1]) else summary[a][fig_key][1]
                for a in arms]
        ax.bar(arms, means, yerr=errs, capsize=4, color="#4c72b0")
        if fig_key == "accuracy" and sft_acc is not None:
            ax.axhline(sft_acc, color="grey", ls="--", lw=1, label="after SFT")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/default", help="a finished default-job run folder")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--budget-s", type=float, default=180.0, help="RL wall-clock budget per arm")
    ap.add_argument("--eval-limit", type=int, default=300)
    ap.add_argument("--eval-k", type=int, default=2)
    ap.add_argument("--lock", default=None, help="hold an exclusive flock on FILE per arm")
    ap.add_argument("--out", default=f"{SCRATCH_DIR}/arpo_vs_grpo")
    ap.add_argument("--results", default=str(RESULTS / "arpo_vs_grpo.json"))
    args = ap.parse_args()

    from arpo_async.core.config import load_config
    from arpo_async.jobs.pipeline import USER_CONFIG
    from toolenv.retriever_server import RetrieverProcess

    src = Path(args.run)
    sft = src / "sft"
    if not (src / USER_CONFIG).is_file() or not (sft / "config.json").is_file():
        raise SystemExit(f"--run {src}: needs a finished default job ({USER_CONFIG} and sft/); "
                         "run `python -m arpo_async.launch` first")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a for a in args.arms.split(",") if a.strip()]
    for arm in arms:
        arm_overrides(arm, 0.5)  # names checked before anything runs
    if "random" in arms and "arpo" not in arms:
        raise SystemExit("--arms: the random arm takes its rate from the arpo arm; add arpo")
    base = load_config(src / USER_CONFIG, [])
    sft_eval = src / "eval" / "sft" / "summary.json"
    sft_acc = json.loads(sft_eval.read_text())["pass@1"] if sft_eval.is_file() else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # arms already finished there are kept
    rows: list[dict] = []
    t0 = time.time()
    total = len(seeds) * len(arms)
    with RetrieverProcess(Path(base.pipeline.data_dir) / "corpus.jsonl") as retriever:
        for i, seed in enumerate(seeds):
            order = arms[i % len(arms):] + arms[:i % len(arms)]
            if "random" in order and order.index("random") < order.index("arpo"):
                order.remove("random")
                order.insert(order.index("arpo") + 1, "random")
            alpha = None
            for arm in order:
                run_dir = out / f"{arm}-seed{seed}"
                if finished(run_dir):
                    row = row_from_folder(run_dir, arm, seed)
                    print(f"[{len(rows) + 1}/{total}] seed {seed} {arm}: finished before, "
                          f"kept ({run_dir})", flush=True)
                else:
                    print(f"[{len(rows) + 1}/{total}] seed {seed} {arm} "
                          f"({time.time() - t0:.0f} s so far)", flush=True)
                    for attempt in (1, 2):
                        shutil.rmtree(run_dir, ignore_errors=True)  # a half-done arm
                        try:
                            with exclusive(args.lock):
                                row = run_arm(base, arm, seed, args, str(sft), retriever.url,
                                              out, alpha)
                            break
                        except RuntimeError as exc:  # e.g. no step inside the budget
                            print(f"    attempt {attempt} failed: {exc}", flush=True)
                            if attempt == 2:
                                raise
                if arm == "arpo":
                    alpha = round(row["decision_weighted_p"], 4)
                rows.append(row)
                print(f"    acc {row['accuracy']:.3f}  tool calls/leaf "
                      f"{row['executed_per_leaf']}  fork rate {row['fork_rate']}  "
                      f"steps {row['steps']}  ({row.get('stage_s')} + {row.get('eval_s')} s)",
                      flush=True)
    summary = summarize(rows)
    print(f"\nheld-out after SFT: {sft_acc}; RL budget {args.budget_s:.0f} s per arm, "
          f"seeds {seeds}")
    print(f"{'arm':8} {'pass@1':>15} {'tools/leaf':>15} {'tools/question':>15} "
          f"{'fork rate':>15} {'steps':>10}")
    for arm, s in summary.items():
        cells = [f"{s[f][0]:.3f} ± {s[f][1]:.3f}" for f in FIGURES[:4]]
        print(f"{arm:8} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} {cells[3]:>15} "
              f"{s['steps'][0]:>10.1f}")
    png = plot(summary, sft_acc, Path(args.results).with_suffix(".png"))
    print(f"wrote {png}")
    write_results("arpo_vs_grpo", {"args": vars(args), "accuracy_after_sft": sft_acc,
                                   "rows": rows, "summary": summary,
                                   "wall_s": round(time.time() - t0, 1)}, args.results)
    if "arpo" in summary and "grpo" in summary:
        ratio = summary["arpo"]["executed_per_leaf"][0] / summary["grpo"]["executed_per_leaf"][0]
        delta = summary["arpo"]["accuracy"][0] - summary["grpo"]["accuracy"][0]
        met = "met" if ratio <= 1.0 and delta >= 0 else "missed"
        print(f"RESULT arpo_vs_grpo tool_calls_ratio={ratio:.3f} accuracy_delta={delta:+.4f} "
              f"target=tool_calls_ratio<=1,accuracy_delta>=0 {met}")
    else:
        print("RESULT arpo_vs_grpo tool_calls_ratio=nan accuracy_delta=nan "
              "target=tool_calls_ratio<=1,accuracy_delta>=0 missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
