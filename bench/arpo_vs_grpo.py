"""ARPO against GRPO, random branching and AEPO on the noisy suite, at equal tool cost.

From one SFT checkpoint of a default job built on the noisy suite (``pipeline.suite_noise``,
``pipeline.suite_slips``: a share of search replies name a wrong entity and a share of the
demonstrator's snippets slip, so after a tool result checking and answering compete),
each arm is a real RL stage (vLLM actors, DeepSpeed learner, sandboxed Python, the noisy
BM25 retriever) followed by the held-out evaluation of its last checkpoint:

- ``grpo``: no branching;
- ``arpo``: entropy branching on the authors' settings: their estimator
  (``entropy_estimator=reference``, top 10), alpha 0.5, beta 0.2, short rounds as they are,
  a fork's own first round as its H_init, one fresh sample per round while none is live
  (``AUTHORS``; tests/unit/test_authors_decisions.py);
- ``arpo_exact``: the same with the exact entropy (vLLM returns each window token's whole
  log-prob vector);
- ``random``: ``beta=0`` and ``alpha`` = the decision-weighted mean P of the same seed's
  ``arpo`` run: as many forks at the same decision points, placed by chance, the ablation
  that isolates the entropy signal;
- ``aepo``: AEPO as the paper describes it, on the same settings: dynamic budget split,
  branch penalty 0.05 with the authors' rule, entropy-balanced clipping, entropy-aware
  advantage (gamma 0.2);
- ``aepo_released`` (only when named in ``--arms``): AEPO as the authors' released scripts
  run it (AEPO/scripts/AEPO_*_DeepResearch.sh:52-54): no dynamic budget, and no
  entropy-aware advantage (theirs never acts: no entropy is computed at entropy_coeff 0).

**Budget: executed tool calls** (``run.tool_call_budget``, the same for every arm): ARPO's
claim is better accuracy per tool call, and on this shared machine wall time measures
the other jobs' load as much as the arm (``--max-s`` only caps a stuck arm, counted from
the first learner step). Each arm's wall time and steps are reported beside it. Every arm
runs once per seed (``run.seed``: the actors' sampling and branching), arm order rotated
per seed (``random`` right after ``arpo``, whose rate it needs).

Reported per arm (mean and standard error over seeds): held-out pass@1 after RL, tool
calls executed and their wall time, tool calls per leaf, fork rate, steps; per seed the
paired differences arpo - random, arpo - grpo, arpo_exact - random; and the null test of
``python -m arpo_async.jobs.analyze entropy`` on the SFT model (does the entropy signal rise
above sampling noise?). JSON to ``--results`` with a plot beside it; the last line is
``RESULT arpo_vs_grpo arpo_minus_random=<x> arpo_minus_grpo=<y> se=<z>
tool_calls_ratio=<r> target=arpo_minus_random>=2se met|missed`` (se: standard error of the
paired arpo - random difference; r: arpo / grpo tool calls per leaf).

    python bench/arpo_vs_grpo.py --run runs/noisy [--seeds 0,1,2,3,4] [--tool-calls 600]
        [--arms grpo,arpo,arpo_exact,random,aepo] [--eval-limit 150] [--eval-k 2]
        [--null-limit 48 --null-k 4] [--lock FILE] [key=value ...]

Arms already finished under ``--out`` are read back, not run again, if their folder
records this code (``git`` commit, plus a hash of uncommitted changes to the packages and
configs) and this arm's config (a hash; ``bench_arm.json``); any other folder is run again.
``--run`` is a
finished default job on the noisy suite, e.g. ``python -m arpo_async.launch run.dir=runs/noisy
pipeline.data_dir=data/noisy task.data=data/noisy/rl.jsonl pipeline.suite_noise=0.3
pipeline.suite_slips=0.2 rollout.tool_call_limit=5 sampling.max_response_tokens=400``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, RESULTS, SCRATCH_DIR, write_results  # noqa: E402

ARMS = ("grpo", "arpo", "arpo_exact", "random", "aepo")
KNOWN_ARMS = (*ARMS, "aepo_released")  # the last runs only when named in --arms
REFERENCE = {"rollout.entropy_estimator": "reference", "sampling.logprobs_topk": 10,
             "rollout.alpha": 0.5, "rollout.beta": 0.2}
# The authors' rollout (vllm_rollout_with_tools.py): short rounds summed as they are, a
# fork's H_init from its own first round, one fresh global sample per round.
AUTHORS = {"rollout.short_round": "as_is", "rollout.fork_h_init": "own",
           "rollout.fill": "one_per_round"}
AEPO_PAPER = {"rollout.aepo_dynamic_budget": True, "rollout.aepo_branch_penalty": 0.05,
              "rollout.aepo_rule": "authors", "learner.loss.aepo_entropy_clip": True,
              "learner.loss.aepo_entropy_adv_gamma": 0.2}
AEPO_RELEASED = {**AEPO_PAPER, "rollout.aepo_dynamic_budget": False,
                 "learner.loss.aepo_entropy_adv_gamma": 0.0}
ARM_RECORD = "bench_arm.json"  # the code and config an arm's folder was run with
CODE_PATHS = ("actors", "learner", "arpo_async", "toolenv", "configs")
PAIRS = (("arpo", "random"), ("arpo", "grpo"), ("arpo_exact", "random"),
         ("arpo_exact", "grpo"), ("aepo", "grpo"), ("random", "grpo"),
         ("aepo_released", "grpo"), ("aepo", "aepo_released"))


def arm_overrides(arm: str, random_alpha: float | None) -> dict:
    if arm == "grpo":
        return {"rollout.mode": "grpo"}
    if arm == "arpo":
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS}
    if arm == "arpo_exact":
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS,
                "rollout.entropy_estimator": "exact"}
    if arm in ("aepo", "aepo_released"):
        return {"rollout.mode": "aepo", **REFERENCE, **AUTHORS,
                **(AEPO_PAPER if arm == "aepo" else AEPO_RELEASED)}
    if arm == "random":
        if random_alpha is None:
            raise ValueError("the random arm needs the same seed's arpo run first")
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS, "rollout.beta": 0.0,
                "rollout.alpha": random_alpha}
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(KNOWN_ARMS)}")


def arm_config(base, arm: str, seed: int, args, out: Path, random_alpha: float | None):
    """The validated config an arm runs with."""
    from arpo_async.core.config import config_from_dict, set_value

    tree = base.model_dump(mode="json")
    overrides = {"run.seed": seed, "run.tool_call_budget": args.tool_calls,
                 "run.time_limit_s": args.max_s,
                 "run.time_limit_from": "first_step",  # start-up, load-dependent, not counted
                 "learner.max_steps": 100000, "pipeline.eval_limit": args.eval_limit,
                 "pipeline.eval_k": args.eval_k, "metrics.wandb": False,
                 **arm_overrides(arm, random_alpha)}
    for key, value in overrides.items():  # on the tree: rollout.mode picks the section's class
        set_value(tree, key, value)
    tree["run"]["dir"] = str(out / f"{arm}-seed{seed}")
    return config_from_dict(tree)


def config_hash(cfg) -> str:
    """sha256 of the config, its run folder left out (a moved --out keeps its arms)."""
    tree = cfg.model_dump(mode="json")
    tree["run"].pop("dir", None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def code_version() -> str:
    """The checkout's commit, plus a hash of uncommitted changes to what a run executes."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout

    diff = git("diff", "HEAD", "--", *CODE_PATHS)
    dirty = f"+{hashlib.sha256(diff.encode()).hexdigest()[:12]}" if diff else ""
    return git("rev-parse", "HEAD").strip() + dirty


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
    from arpo_async.core.rundir import latest_checkpoint
    from arpo_async.jobs.pipeline import run_eval, run_rl

    cfg = arm_config(base, arm, seed, args, out, random_alpha)
    run_dir = Path(cfg.run.dir)
    record = {"code": code_version(), "config_sha": config_hash(cfg)}  # before the run
    run_dir.mkdir(parents=True)
    t0 = time.time()
    run_rl(cfg, run_dir, sft, url, quiet=True)
    t_rl = time.time() - t0
    run_eval(cfg, str(latest_checkpoint(run_dir)), url, run_dir / "eval")
    timing = {"stage_s": round(t_rl, 1), "eval_s": round(time.time() - t0 - t_rl, 1),
              "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    (run_dir / "bench_timing.json").write_text(json.dumps(timing))
    (run_dir / ARM_RECORD).write_text(json.dumps(record))  # last: the arm is complete
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
           "tool_calls_per_sample": ev["tool_calls_per_sample"],
           "no_tool_share": ev.get("no_tool_share"), "tool_calls": rl.get("tool_calls"),
           "executed_per_leaf": rl.get("tools_executed_per_leaf_mean"),
           "fork_rate": rl.get("fork_rate"), "p_outside_band_share": rl.get("p_outside_band_share"),
           "p_mean": rl.get("branch_p_mean_mean"), "steps": rl.get("steps"),
           "rl_wall_s": rl.get("rl_wall_s"), "alpha": cfg.rollout.alpha,
           "beta": cfg.rollout.beta, "estimator": cfg.rollout.entropy_estimator,
           "run_dir": str(run_dir),
           **(json.loads(timing_path.read_text()) if timing_path.is_file() else {})}
    if arm == "arpo":
        row["decision_weighted_p"] = decision_weighted_p(run_dir)
    return row


def finished(run_dir: Path, want: dict) -> bool:
    """Whether ``run_dir`` holds this arm, done and evaluated, run by the same code with
    the same config (``want``: its ``ARM_RECORD``); any other folder is run again."""
    path = run_dir / ARM_RECORD
    if not (run_dir / "eval" / "summary.json").is_file() or not path.is_file():
        if run_dir.exists():
            print(f"    {run_dir.name}: unfinished, or from before {ARM_RECORD}: run again",
                  flush=True)
        return False
    had = json.loads(path.read_text())
    for key, what in (("code", "other code"), ("config_sha", "another config")):
        if had.get(key) != want[key]:
            print(f"    {run_dir.name}: run by {what} ({had.get(key)}, now {want[key]}): "
                  "run again", flush=True)
            return False
    return True


def mean_se(values: list[float]) -> tuple[float, float]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return m, math.sqrt(var / len(vals))


FIGURES = ("accuracy", "tool_calls", "rl_wall_s", "executed_per_leaf",
           "tool_calls_per_sample", "fork_rate", "p_outside_band_share", "steps")


def summarize(rows: list[dict]) -> dict:
    out = {}
    for arm in KNOWN_ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if mine:
            out[arm] = {"n": len(mine), **{f: mean_se([r[f] for r in mine]) for f in FIGURES}}
    return out


def paired(rows: list[dict]) -> dict:
    """Per seed differences of held-out pass@1 between arms, with their mean and s.e."""
    acc = {(r["arm"], r["seed"]): r["accuracy"] for r in rows}
    out = {}
    for a, b in PAIRS:
        seeds = sorted(s for (arm, s) in acc if arm == a and (b, s) in acc)
        diffs = [acc[(a, s)] - acc[(b, s)] for s in seeds]
        if diffs:
            m, se = mean_se(diffs)
            out[f"{a}-{b}"] = {"seeds": seeds, "diffs": diffs, "mean": m, "se": se}
    return out


def null_test(base, sft: Path, data_dir: Path, args) -> dict:
    """The analyze command's null test on the SFT model, for the reference settings."""
    from arpo_async.jobs.analyze import entropy_analysis

    cfg = base.model_copy(deep=True)
    for key, value in REFERENCE.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg.model.path, cfg.run.dir = str(sft), str(Path(args.out) / "null_test")
    done = Path(args.out) / "null_test" / "entropy.json"
    if done.is_file():  # an interrupted bench: the same model and sizes are read back
        res = json.loads(done.read_text())
        if (res.get("model"), res.get("prompts"), res.get("samples_per_prompt")) == \
                (str(sft), args.null_limit, args.null_k):
            return {"finding": res["finding"], "rows": res["null_test"]}
    res = entropy_analysis(cfg, data_dir / "heldout.jsonl", data_dir / "corpus.jsonl",
                           Path(args.out) / "null_test", args.null_limit, args.null_k)
    return {"finding": res["finding"], "rows": res["null_test"]}


def plot(summary: dict, sft_acc: float | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (fig_key, label) in zip(axes, [("accuracy", "held-out pass@1 after RL"),
                                           ("executed_per_leaf", "tool calls per leaf (RL)"),
                                           ("rl_wall_s", "RL wall time at equal tool calls, s")]):
        means = [summary[a][fig_key][0] for a in arms]
        errs = [0 if math.isnan(summary[a][fig_key][1]) else summary[a][fig_key][1]
                for a in arms]
        ax.bar(arms, means, yerr=errs, capsize=4, color="#4c72b0")
        if fig_key == "accuracy" and sft_acc is not None:
            ax.axhline(sft_acc, color="grey", ls="--", lw=1, label="after SFT")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/noisy", help="a finished default job on the noisy suite")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--tool-calls", type=int, default=600,
                    help="RL budget per arm: tool calls executed by the groups trained")
    ap.add_argument("--max-s", type=float, default=900.0,
                    help="wall-clock cap per arm after its first step, s (a stuck arm)")
    ap.add_argument("--eval-limit", type=int, default=150)
    ap.add_argument("--eval-k", type=int, default=2)
    ap.add_argument("--null-limit", type=int, default=48, help="null test: held-out prompts")
    ap.add_argument("--null-k", type=int, default=4, help="null test: samples per prompt")
    ap.add_argument("--lock", default=None, help="hold an exclusive flock on FILE per arm")
    ap.add_argument("--out", default=f"{SCRATCH_DIR}/arpo_vs_grpo")
    ap.add_argument("--results", default=str(RESULTS / "arpo_vs_grpo.json"))
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="applied to the run's config before the arms' own keys")
    return ap.parse_args()


def run_seed(i: int, seed: int, arms: list[str], base, args, sft: Path, url: str, out: Path,
             rows: list[dict], total: int, t0: float) -> None:
    order = arms[i % len(arms):] + arms[:i % len(arms)]
    if "random" in order and order.index("random") < order.index("arpo"):
        order.remove("random")
        order.insert(order.index("arpo") + 1, "random")
    alpha = None
    for arm in order:
        run_dir = out / f"{arm}-seed{seed}"
        want = {"code": code_version(),
                "config_sha": config_hash(arm_config(base, arm, seed, args, out, alpha))}
        if finished(run_dir, want):
            row = row_from_folder(run_dir, arm, seed)
            print(f"[{len(rows) + 1}/{total}] seed {seed} {arm}: finished before, kept",
                  flush=True)
        else:
            print(f"[{len(rows) + 1}/{total}] seed {seed} {arm} ({time.time() - t0:.0f} s so "
                  "far)", flush=True)
            for attempt in (1, 2):
                shutil.rmtree(run_dir, ignore_errors=True)  # a half-done arm
                try:
                    with exclusive(args.lock):
                        row = run_arm(base, arm, seed, args, str(sft), url, out, alpha)
                    break
                except RuntimeError as exc:  # e.g. no step inside the budget
                    print(f"    attempt {attempt} failed: {exc}", flush=True)
                    if attempt == 2:
                        raise
        if arm == "arpo":
            alpha = round(row["decision_weighted_p"], 4)
        rows.append(row)
        print(f"    acc {row['accuracy']:.3f}  tool calls {row['tool_calls']} "
              f"({row['executed_per_leaf']}/leaf)  fork rate {row['fork_rate']}  steps "
              f"{row['steps']}  RL {row['rl_wall_s']} s  ({row.get('stage_s')} + "
              f"{row.get('eval_s')} s)", flush=True)


def _cell(s: dict, figure: str, digits: int = 3) -> str:
    return f"{s[figure][0]:.{digits}f} ± {s[figure][1]:.{digits}f}"


def report(summary: dict, pairs: dict, null: dict | None, sft_acc, args) -> None:
    print(f"\nheld-out after SFT: {sft_acc}; RL budget {args.tool_calls} executed tool calls "
          f"per arm")
    print(f"{'arm':10} {'pass@1':>15} {'tool calls':>13} {'RL wall s':>13} "
          f"{'tools/leaf':>15} {'fork rate':>15} {'steps':>8}")
    for arm, s in summary.items():
        print(f"{arm:10} {_cell(s, 'accuracy'):>15} {s['tool_calls'][0]:>13.0f} "
              f"{_cell(s, 'rl_wall_s', 0):>13} {_cell(s, 'executed_per_leaf'):>15} "
              f"{_cell(s, 'fork_rate'):>15} {s['steps'][0]:>8.1f}")
    for name, p in pairs.items():
        diffs = ", ".join(f"{d:+.3f}" for d in p["diffs"])
        print(f"paired {name:18} {p['mean']:+.4f} ± {p['se']:.4f}  (per seed: {diffs})")
    if null:
        print(null["finding"])


def main() -> int:
    args = parse_args()
    from arpo_async.core.config import load_config
    from arpo_async.jobs.pipeline import USER_CONFIG
    from toolenv.retriever_server import RetrieverProcess
    from toolenv.tasks.suite import suite_noise

    src = Path(args.run)
    sft = src / "sft"
    if not (src / USER_CONFIG).is_file() or not (sft / "config.json").is_file():
        raise SystemExit(f"--run {src}: needs a finished default job ({USER_CONFIG} and sft/); "
                         "see this script's docstring")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a for a in args.arms.split(",") if a.strip()]
    for arm in arms:
        arm_overrides(arm, 0.5)  # names checked before anything runs
    if "random" in arms and "arpo" not in arms:
        raise SystemExit("--arms: the random arm takes its rate from the arpo arm; add arpo")
    base = load_config(src / USER_CONFIG, args.overrides)
    data_dir = Path(base.pipeline.data_dir)
    sft_eval = src / "eval" / "sft" / "summary.json"
    sft_acc = json.loads(sft_eval.read_text())["pass@1"] if sft_eval.is_file() else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # arms already finished there are kept
    t0 = time.time()
    null = null_test(base, sft, data_dir, args) if args.null_limit else None
    rows: list[dict] = []
    corpus = data_dir / "corpus.jsonl"
    with RetrieverProcess(corpus, **suite_noise(corpus)) as retriever:
        for i, seed in enumerate(seeds):
            run_seed(i, seed, arms, base, args, sft, retriever.url, out, rows,
                     len(seeds) * len(arms), t0)
    summary, pairs = summarize(rows), paired(rows)
    report(summary, pairs, null, sft_acc, args)
    png = plot(summary, sft_acc, Path(args.results).with_suffix(".png"))
    print(f"wrote {png}")
    write_results("arpo_vs_grpo", {"args": vars(args), "accuracy_after_sft": sft_acc,
                                   "suite": suite_noise(corpus), "rows": rows,
                                   "summary": summary, "paired": pairs, "null_test": null,
                                   "wall_s": round(time.time() - t0, 1)}, args.results)
    vs_random, vs_grpo = pairs.get("arpo-random", {}), pairs.get("arpo-grpo", {})
    x, se = vs_random.get("mean", float("nan")), vs_random.get("se", float("nan"))
    y = vs_grpo.get("mean", float("nan"))
    ratio = (summary["arpo"]["executed_per_leaf"][0] / summary["grpo"]["executed_per_leaf"][0]
             if "arpo" in summary and "grpo" in summary else float("nan"))
    met = "met" if x >= 2 * se else "missed"  # nan compares false: missed
    print(f"RESULT arpo_vs_grpo arpo_minus_random={x:+.4f} arpo_minus_grpo={y:+.4f} "
          f"se={se:.4f} tool_calls_ratio={ratio:.3f} target=arpo_minus_random>=2se {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
