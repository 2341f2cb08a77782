"""ARPO against GRPO, random branching and AEPO at equal tool cost: the verdict (issue 35).

From one SFT checkpoint of a default job (``--run``; the recover suite or the default
suite), each arm is a real RL stage (vLLM actors, DeepSpeed learner, sandboxed Python, the
suite's BM25 retriever) stopped at ``--tool-calls`` executed tool calls
(``run.tool_call_budget``), with a checkpoint at every ``--curve-every`` calls, each
evaluated on the held-out prompts (``--eval-limit`` x ``--eval-k``):

- ``grpo``: no branching;
- ``arpo``: entropy branching on the authors' settings: their estimator
  (``entropy_estimator=reference``, top 10), alpha 0.5, beta 0.2, short rounds as they are,
  a fork's own first round as its H_init, one fresh sample per round while none is live
  (``AUTHORS``; tests/unit/test_authors_decisions.py);
- ``random``: ``beta=0`` and ``alpha`` = the decision-weighted mean P of the same seed's
  ``arpo`` run: as many forks at the same decision points, placed by chance;
- ``random_strat``: ``rollout.mode=stratified``, P per stratum (the tool before the round
  and that call's index) as the same seed's ``arpo`` run placed them: separates "entropy
  picks the states" from "entropy is higher after a search than after Python";
- ``aepo``: AEPO as the paper describes it, on the same settings: dynamic budget split,
  branch penalty 0.05 with the authors' rule, entropy-balanced clipping, entropy-aware
  advantage (gamma 0.2);
- ``arpo_max``: ARPO with the signal that passed the outcome test on the recover suite:
  the window's most uncertain token (``entropy_reduce=max``, tail-corrected top 10,
  beta 1.5), the rest as ``arpo``;
- ``arpo_exact``, ``aepo_released`` (only when named in ``--arms``): the exact entropy;
  AEPO as the authors' released scripts run it (no dynamic budget, an entropy-aware
  advantage that never acts).

**Budget: executed tool calls**, the same for every arm (ARPO's claim is accuracy per
tool call; wall time on this shared machine measures the other jobs as much as the arm).
Every arm runs once per seed (``run.seed``), arm order rotated per seed, the matched
random arms right after ``arpo``.

**Declared in git before the runs** (``--declared bench/declared/<name>.json``,
bench/declared.py): arms run only under a declaration git holds unchanged at HEAD whose
design equals this run's (arms, seeds, budget, ...), naming arms this bench implements,
with power for its predicted effect (the minimum detectable effect is printed first;
``--underpowered`` runs a design that cannot detect it). Its primary endpoint (a figure
and an arms contrast, e.g. recovery after a wrong search result, arm minus grpo) is read
with its declared test: paired per seed, mean +- t(0.975, n-1) s.e., t and exact sign-flip
p-values, met or missed by its rule, written to ``OUT/declared_result.json``. The tables
beside it: pass@1, pass@k, recovery and the executed tool calls to reach the SFT model's
pass@1 + ``--target-gain`` (linear between checkpoints, censored at the budget), paired
over the fixed ``PAIRS``. ``--report-only`` without ``--declared`` reads older runs (their
``OUT/endpoints.json`` is no longer read) and prints no declared fields.

JSON to ``--results`` with two plots beside it (the arms' bars; accuracy against tool
calls with s.e. bands); the last line is ``RESULT arpo_vs_grpo arpo_minus_random=<x>
arpo_minus_grpo=<y> se=<z> recovery_arpo_minus_grpo=<r> calls_to_sft_plus5_ratio=<q>
seeds=<n> budget=<b> target=arpo_minus_random>=2se met|missed``, then under a declaration
``declared=<name> mde=<m> underpowered=<bool> primary=<mean> lo=<l> hi=<h> p_t=<p>
p_perm=<p> n=<n> rule=<rule> met|missed|incomplete`` (incomplete: seeds still missing).

    python bench/arpo_vs_grpo.py --declared bench/declared/NAME.json [--underpowered]
        --run runs/recover --out runs/verdict_recover
        [--seeds 0,1,2,3,4] [--tool-calls 2500] [--curve-every 500]
        [--arms grpo,arpo,random,random_strat,aepo] [--eval-limit 300] [--eval-k 4]
        [--null-limit 48 --null-k 4] [--lock FILE] [key=value ...]

Arms already finished under ``--out`` are read back, not run again, if their folder
records this code (the git trees of the packages and configs, plus a hash of uncommitted
changes to them) and this arm's config (a hash; ``bench_arm.json``); any other folder is
run again. ``--run`` is a finished default job, e.g. the recover suite:
``python -m arpo_async.launch run.dir=runs/recover pipeline.data_dir=data/recover
task.data=data/recover/rl.jsonl pipeline.suite_noise=0.4
"pipeline.suite_noise_note=No exact match." pipeline.suite_slips=0
pipeline.suite_recover=0.5 pipeline.suite_direct=0 rollout.tool_call_limit=5
sampling.max_response_tokens=400 run.time_limit_s=60``.
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

import declared  # noqa: E402
from common import REPO, RESULTS, SCRATCH_DIR, write_results  # noqa: E402
from verdict import (  # noqa: E402
    calls_to_reach,
    checkpoint_calls,
    curve_bands,
    mean_ci,
    plot_curves,
    stratum_table,
)

ARMS = ("grpo", "arpo", "random", "random_strat", "aepo", "arpo_max")
# these run only when named in --arms; arpo_tree / arpo_tree_grpo: arpo's rollout with tree
# credit (learner.loss.advantage, learner/advantages.py; issue 55)
KNOWN_ARMS = (*ARMS, "arpo_exact", "aepo_released", "arpo_tree", "arpo_tree_grpo")
REFERENCE = {"rollout.entropy_estimator": "reference", "sampling.logprobs_topk": 10,
             "rollout.alpha": 0.5, "rollout.beta": 0.2}
# The authors' rollout (vllm_rollout_with_tools.py): short rounds summed as they are, a
# fork's H_init from its own first round, one fresh global sample per round.
AUTHORS = {"rollout.short_round": "as_is", "rollout.fork_h_init": "own",
           "rollout.fill": "one_per_round"}
# The signal that passed the outcome test on the recover suite (bench/README.md): the most
# uncertain token of the window (a one-token decision), its own scale for beta.
MAX_TOKEN = {"rollout.entropy_estimator": "tail_corrected", "rollout.entropy_reduce": "max",
             "rollout.beta": 1.5}
AEPO_PAPER = {"rollout.aepo_dynamic_budget": True, "rollout.aepo_branch_penalty": 0.05,
              "rollout.aepo_rule": "authors", "learner.loss.aepo_entropy_clip": True,
              "learner.loss.aepo_entropy_adv_gamma": 0.2}
AEPO_RELEASED = {**AEPO_PAPER, "rollout.aepo_dynamic_budget": False,
                 "learner.loss.aepo_entropy_adv_gamma": 0.0}
ARM_RECORD = "bench_arm.json"  # the code and config an arm's folder was run with
CODE_PATHS = ("actors", "learner", "arpo_async", "toolenv", "configs")
PAIRS = (("arpo", "random"), ("arpo", "random_strat"), ("arpo", "grpo"),
         ("arpo_max", "grpo"), ("arpo_max", "random_strat"), ("arpo_max", "arpo"),
         ("random", "grpo"), ("random_strat", "grpo"), ("aepo", "grpo"),
         ("arpo_exact", "random"), ("arpo_exact", "grpo"), ("aepo_released", "grpo"),
         ("aepo", "aepo_released"), ("arpo_tree", "arpo"), ("arpo_tree_grpo", "arpo"),
         ("arpo_tree", "arpo_tree_grpo"))
MATCHED = ("random", "random_strat")  # arms that take their rates from the seed's arpo run


def arm_overrides(arm: str, random_alpha: float | None,
                  strata: dict[str, float] | None = None) -> dict:
    if arm == "grpo":
        return {"rollout.mode": "grpo"}
    if arm == "arpo":
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS}
    if arm == "arpo_max":
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS, **MAX_TOKEN}
    if arm == "arpo_exact":
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS,
                "rollout.entropy_estimator": "exact"}
    if arm in ("arpo_tree", "arpo_tree_grpo"):
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS,
                "learner.loss.advantage": arm.removeprefix("arpo_")}
    if arm in ("aepo", "aepo_released"):
        return {"rollout.mode": "aepo", **REFERENCE, **AUTHORS,
                **(AEPO_PAPER if arm == "aepo" else AEPO_RELEASED)}
    if arm in MATCHED and random_alpha is None:
        raise ValueError(f"the {arm} arm needs the same seed's arpo run first")
    if arm == "random":
        return {"rollout.mode": "arpo", **REFERENCE, **AUTHORS, "rollout.beta": 0.0,
                "rollout.alpha": random_alpha}
    if arm == "random_strat":  # P per tool and call index as the arpo run placed them
        return {"rollout.mode": "stratified", **REFERENCE, **AUTHORS,
                "rollout.alpha": random_alpha, "rollout.stratum_p": dict(strata or {})}
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(KNOWN_ARMS)}")


def arm_config(base, arm: str, seed: int, args, out: Path, random_alpha: float | None,
               strata: dict[str, float] | None = None):
    """The validated config an arm runs with."""
    from arpo_async.core.config import config_from_dict, set_value

    tree = base.model_dump(mode="json")
    overrides = {"run.seed": seed, "run.tool_call_budget": args.tool_calls,
                 "run.time_limit_s": args.max_s,
                 "run.time_limit_from": "first_step",  # start-up, load-dependent, not counted
                 "learner.max_steps": 100000, "pipeline.eval_limit": args.eval_limit,
                 "pipeline.eval_k": args.eval_k, "metrics.wandb": False,
                 **curve_overrides(args), **arm_overrides(arm, random_alpha, strata)}
    for key, value in overrides.items():  # on the tree: rollout.mode picks the section's class
        set_value(tree, key, value)
    tree["run"]["dir"] = str(out / f"{arm}-seed{seed}")
    return config_from_dict(tree)


def curve_overrides(args) -> dict:
    """A checkpoint at every ``--curve-every`` tool calls, all kept (the learning curve)."""
    every = getattr(args, "curve_every", 0)
    if not every:
        return {}
    return {"learner.checkpoint_every_tool_calls": every, "learner.checkpoint_every": 0,
            "learner.keep_checkpoints": args.tool_calls // every + 10}  # overshoot: in flight


def config_hash(cfg) -> str:
    """sha256 of the config, its run folder left out (a moved --out keeps its arms)."""
    tree = cfg.model_dump(mode="json")
    tree["run"].pop("dir", None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def code_version() -> str:
    """The git trees of what a run executes (``CODE_PATHS``: a commit that touches only
    tests, docs or benches keeps the arms), plus a hash of uncommitted changes to them."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout

    trees = git("rev-parse", *(f"HEAD:{path}" for path in CODE_PATHS))
    diff = git("diff", "HEAD", "--", *CODE_PATHS)
    dirty = f"+{hashlib.sha256(diff.encode()).hexdigest()[:12]}" if diff else ""
    return "trees-" + hashlib.sha256(trees.encode()).hexdigest()[:16] + dirty


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
            random_alpha: float | None, strata: dict[str, float] | None) -> dict:
    from arpo_async.core.rundir import complete_checkpoints, latest_checkpoint
    from arpo_async.jobs.pipeline import run_eval, run_rl

    cfg = arm_config(base, arm, seed, args, out, random_alpha, strata)
    run_dir = Path(cfg.run.dir)
    record = {"code": code_version(), "config_sha": config_hash(cfg)}  # before the run
    run_dir.mkdir(parents=True)
    t0 = time.time()
    run_rl(cfg, run_dir, sft, url, quiet=True)
    t_rl = time.time() - t0
    last = latest_checkpoint(run_dir)
    for ckpt in complete_checkpoints(run_dir) if args.curve_every else []:
        if ckpt != last:  # the curve's earlier points; the last one is the arm's result
            run_eval(cfg, str(ckpt), url, run_dir / "eval" / "curve" / ckpt.name)
    run_eval(cfg, str(last), url, run_dir / "eval")
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
    k = cfg.pipeline.eval_k
    timing_path = run_dir / "bench_timing.json"
    row = {"arm": arm, "seed": seed, "accuracy": ev["pass@1"], "pass@k": ev.get(f"pass@{k}"),
           **eval_point(run_dir / "eval", suite_note(cfg)),
           "curve": curve(run_dir, k, suite_note(cfg)),
           "tool_calls_per_sample": ev["tool_calls_per_sample"],
           "no_tool_share": ev.get("no_tool_share"), "tool_calls": rl.get("tool_calls"),
           "executed_per_leaf": rl.get("tools_executed_per_leaf_mean"),
           "fork_rate": rl.get("fork_rate"), "p_outside_band_share": rl.get("p_outside_band_share"),
           "p_mean": rl.get("branch_p_mean_mean"), "steps": rl.get("steps"),
           "rl_wall_s": rl.get("rl_wall_s"), "alpha": cfg.rollout.alpha,
           "nonzero_var_share": (rl.get("nonzero_var") or {}).get("share"),
           # an arm its wall-time cap stopped before its tool-call budget is not at equal cost
           "budget_reached": (rl.get("tool_calls") or 0) >= cfg.run.tool_call_budget,
           "beta": cfg.rollout.beta, "estimator": cfg.rollout.entropy_estimator,
           "run_dir": str(run_dir),
           **(json.loads(timing_path.read_text()) if timing_path.is_file() else {})}
    if arm == "arpo":
        row["decision_weighted_p"] = decision_weighted_p(run_dir)
        row["strata"] = stratum_table(run_dir)
    if arm == "random_strat":
        row["stratum_p"] = dict(cfg.rollout.stratum_p)
    return row


def suite_note(cfg) -> str:
    """The note the suite's retriever puts on a wrong reply ('' for a suite without)."""
    from toolenv.tasks.suite import suite_noise

    return suite_noise(Path(cfg.pipeline.data_dir) / "corpus.jsonl")["noise_note"]


def eval_point(folder: Path, note: str) -> dict:
    """An evaluation's figures beyond pass@1: the recovery after a wrong search result
    (toolenv/tasks/suite.py ``recovery``: a noted reply when the suite notes them, else a
    reply naming another entity), from its items."""
    from toolenv.tasks.suite import recovery

    items = [json.loads(line) for line in (folder / "items.jsonl").read_text().splitlines()
             if line.strip()]
    rec = recovery(items, note)
    return {"recovery": rec["rate"], "recovery_n": rec["n"], "wrong_result_share": rec["share"]}


def curve(run_dir: Path, k: int, note: str) -> list[dict]:
    """The arm's learning curve: (tool calls trained, pass@1, pass@k, recovery) at each
    evaluated checkpoint, the last one included."""
    from arpo_async.core.rundir import complete_checkpoints

    points = []
    ckpts = complete_checkpoints(run_dir)
    for i, ckpt in enumerate(ckpts):
        folder = run_dir / "eval" / ("curve/" + ckpt.name if i < len(ckpts) - 1 else "")
        if (folder / "summary.json").is_file():
            ev = json.loads((folder / "summary.json").read_text())
            points.append({"calls": checkpoint_calls(ckpt), "step": int(ckpt.name[5:]),
                           "pass@1": ev["pass@1"], "pass@k": ev.get(f"pass@{k}"),
                           "recovery": eval_point(folder, note)["recovery"]})
    return points


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
    """(mean, standard error), None and nan left out (bench/verdict.py ``mean_ci``)."""
    ci = mean_ci(values)
    return ci["mean"], ci["se"]


FIGURES = ("accuracy", "pass@k", "recovery", "wrong_result_share", "tool_calls", "rl_wall_s",
           "executed_per_leaf", "tool_calls_per_sample", "fork_rate", "p_outside_band_share",
           "steps", "calls_to_target")


def summarize(rows: list[dict]) -> dict:
    out = {}
    for arm in KNOWN_ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if mine:
            out[arm] = {"n": len(mine), **{f: mean_se([r[f] for r in mine]) for f in FIGURES},
                        "reached_target": sum(bool(r.get("reached_target")) for r in mine)}
    return out


def paired(rows: list[dict], figure: str = "accuracy") -> dict:
    """Per seed differences of ``figure`` between arms: mean, s.e. and 95% t interval."""
    acc = {(r["arm"], r["seed"]): r.get(figure) for r in rows}
    out = {}
    for a, b in PAIRS:
        seeds = sorted(s for (arm, s) in acc if arm == a and (b, s) in acc
                       and acc[(a, s)] is not None and acc[(b, s)] is not None)
        diffs = [acc[(a, s)] - acc[(b, s)] for s in seeds]
        if diffs:
            out[f"{a}-{b}"] = {"seeds": seeds, "diffs": diffs, **mean_ci(diffs)}
    return out


def add_calls_to_target(rows: list[dict], sft_acc: float | None, gain: float,
                        budget: int) -> None:
    """Each row's executed tool calls to reach the SFT model's pass@1 + ``gain`` (censored
    at the budget, or its last checkpoint past it, when not reached: ``reached_target``
    false)."""
    for row in rows:
        if sft_acc is None or not row.get("curve"):
            row["calls_to_target"], row["reached_target"] = None, None
            continue
        points = [(0.0, sft_acc)] + [(c["calls"], c["pass@1"]) for c in row["curve"]]
        row["calls_to_target"], row["reached_target"] = calls_to_reach(points, sft_acc + gain,
                                                                       budget)


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
    ap.add_argument("--tool-calls", type=int, default=2500,
                    help="RL budget per arm: tool calls executed by the groups trained")
    ap.add_argument("--curve-every", type=int, default=500,
                    help="a checkpoint, evaluated, at every this many tool calls (0: the "
                    "last only)")
    ap.add_argument("--target-gain", type=float, default=0.05,
                    help="the curve's target: the SFT model's pass@1 plus this")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: the tables and the RESULT line of the arms finished "
                    "under --out so far (a verdict that spans sessions)")
    ap.add_argument("--declared", default=None, metavar="bench/declared/NAME.json",
                    help="the declaration, committed before the first arm, that this run's "
                    "design must equal and whose primary endpoint the RESULT line reads")
    ap.add_argument("--underpowered", action="store_true",
                    help="run a declared design whose minimum detectable effect exceeds its "
                    "predicted effect")
    ap.add_argument("--max-s", type=float, default=900.0,
                    help="wall-clock cap per arm after its first step, s (a stuck arm)")
    ap.add_argument("--eval-limit", type=int, default=300)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--null-limit", type=int, default=48, help="null test: held-out prompts")
    ap.add_argument("--null-k", type=int, default=4, help="null test: samples per prompt")
    ap.add_argument("--lock", default=None, help="hold an exclusive flock on FILE per arm")
    ap.add_argument("--out", default=f"{SCRATCH_DIR}/arpo_vs_grpo")
    ap.add_argument("--results", default=str(RESULTS / "arpo_vs_grpo.json"))
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="applied to the run's config before the arms' own keys")
    return ap.parse_intermixed_args()  # key=value overrides may follow the options


def run_seed(i: int, seed: int, arms: list[str], base, args, sft: Path, url: str, out: Path,
             rows: list[dict], total: int, t0: float) -> None:
    order = arms[i % len(arms):] + arms[:i % len(arms)]
    for arm in reversed(MATCHED):  # right after arpo, whose rates they need
        if arm in order:
            order.remove(arm)
            order.insert(order.index("arpo") + 1, arm)
    alpha = strata = None
    for arm in order:
        run_dir = out / f"{arm}-seed{seed}"
        if args.report_only and arm in MATCHED and alpha is None:
            print(f"    seed {seed} {arm}: its arpo run is not finished", flush=True)
            continue
        cfg = arm_config(base, arm, seed, args, out, alpha, strata)
        want = {"code": code_version(), "config_sha": config_hash(cfg)}
        if finished(run_dir, want):
            row = row_from_folder(run_dir, arm, seed)
            print(f"[{len(rows) + 1}/{total}] seed {seed} {arm}: finished before, kept",
                  flush=True)
        elif args.report_only:
            continue
        else:
            print(f"[{len(rows) + 1}/{total}] seed {seed} {arm} ({time.time() - t0:.0f} s so "
                  "far)", flush=True)
            for attempt in (1, 2):
                shutil.rmtree(run_dir, ignore_errors=True)  # a half-done arm
                try:
                    with exclusive(args.lock):
                        row = run_arm(base, arm, seed, args, str(sft), url, out, alpha,
                                      strata)
                    break
                except RuntimeError as exc:  # e.g. no step inside the budget
                    print(f"    attempt {attempt} failed: {exc}", flush=True)
                    if attempt == 2:
                        raise
        if arm == "arpo":
            alpha, strata = round(row["decision_weighted_p"], 4), row["strata"]
        rows.append(row)
        print(f"    acc {row['accuracy']:.3f}  recovery {row['recovery']:.3f}  tool calls "
              f"{row['tool_calls']} "
              f"({row['executed_per_leaf']}/leaf)  fork rate {row['fork_rate']}  steps "
              f"{row['steps']}  RL {row['rl_wall_s']} s  ({row.get('stage_s')} + "
              f"{row.get('eval_s')} s)", flush=True)


def _cell(s: dict, figure: str, digits: int = 3) -> str:
    return f"{s[figure][0]:.{digits}f} ± {s[figure][1]:.{digits}f}"


def capped_lines(rows: list[dict]) -> list[str]:
    """A warning for each arm its wall-time cap (``--max-s``) stopped before its tool-call
    budget: its figures are not at equal cost (issue 53 item 5)."""
    return [f"WARNING {r['arm']} seed {r['seed']}: stopped by --max-s at {r.get('tool_calls')} "
            "executed tool calls, before its budget: not at equal cost"
            for r in rows if r.get("budget_reached") is False]


def report(summary: dict, pairs: dict, sft: dict, null: dict | None, args,
           rows: list[dict] = ()) -> None:
    print(f"\nheld-out after SFT: pass@1 {sft['pass@1']}, recovery {sft['recovery']:.3f}; RL "
          f"budget {args.tool_calls} executed tool calls per arm; {args.eval_limit} prompts x "
          f"{args.eval_k}; calls to +5: (seeds that reached it / seeds; the others count "
          "at the budget)")
    print(f"{'arm':12} {'pass@1':>15} {'pass@k':>15} {'recovery':>15} {'calls to +5':>19} "
          f"{'tools/leaf':>15} {'fork rate':>15} {'steps':>7}")
    for arm, s in summary.items():
        calls = f"{_cell(s, 'calls_to_target', 0)} ({s['reached_target']}/{s['n']})"
        print(f"{arm:12} {_cell(s, 'accuracy'):>15} {_cell(s, 'pass@k'):>15} "
              f"{_cell(s, 'recovery'):>15} {calls:>19} "
              f"{_cell(s, 'executed_per_leaf'):>15} {_cell(s, 'fork_rate'):>15} "
              f"{s['steps'][0]:>7.1f}")
    for line in capped_lines(rows):
        print(line)
    for figure, table in pairs.items():
        for name, p in table.items():
            diffs = ", ".join(f"{d:+.3f}" for d in p["diffs"])
            print(f"paired {figure:9} {name:19} {p['mean']:+.4f} ± {p['se']:.4f} (95% t "
                  f"{p['lo']:+.4f} to {p['hi']:+.4f}; per seed: {diffs})")
    if null:
        print(null["finding"])


def sft_point(base, args, sft: Path, url: str, out: Path) -> dict:
    """The shared SFT model evaluated as the arms are (OUT/sft_eval; read back on a rerun
    with the same sizes): the curves' first point and the target's base."""
    from arpo_async.jobs.pipeline import run_eval

    folder = out / "sft_eval"
    summary = folder / "summary.json"
    done = json.loads(summary.read_text()) if summary.is_file() else {}
    if (done.get("n"), done.get("k")) != (args.eval_limit, args.eval_k):
        cfg = arm_config(base, "grpo", 0, args, out, None)
        run_eval(cfg, str(sft), url, folder)
        done = json.loads(summary.read_text())
    return {"pass@1": done["pass@1"], "pass@k": done.get(f"pass@{args.eval_k}"),
            **eval_point(folder, suite_note(base))}


def verdict_line(summary: dict, pairs: dict, args, spec: dict | None = None,
                 result: dict | None = None) -> str:
    acc, rec = pairs["accuracy"], pairs["recovery"]
    x = acc.get("arpo-random", {}).get("mean", float("nan"))
    se = acc.get("arpo-random", {}).get("se", float("nan"))
    y = acc.get("arpo-grpo", {}).get("mean", float("nan"))
    r = rec.get("arpo-grpo", {}).get("mean", float("nan"))
    calls = {a: summary.get(a, {}).get("calls_to_target", (float("nan"),))[0]
             for a in ("arpo", "grpo")}
    q = calls["arpo"] / calls["grpo"] if calls["grpo"] else float("nan")
    n = len(acc.get("arpo-random", acc.get("arpo-grpo", {})).get("seeds", []))  # finished
    met = "met" if x >= 2 * se else "missed"  # nan compares false: missed
    return (f"RESULT arpo_vs_grpo arpo_minus_random={x:+.4f} arpo_minus_grpo={y:+.4f} "
            f"se={se:.4f} recovery_arpo_minus_grpo={r:+.4f} calls_to_sft_plus5_ratio={q:.3f} "
            f"seeds={n} budget={args.tool_calls} target=arpo_minus_random>=2se {met}"
            + (f" {declared.result_fields(result, spec['power'])}" if result else ""))


def declare_run(args, src: Path, seeds: list[int], arms: list[str]) -> dict | None:
    """The declaration this run is held to (bench/declared.py ``prepare``: committed,
    arms known, design equal, powered, pinned to OUT), checked before anything runs; None
    for ``--report-only`` without one (older runs: no declared fields)."""
    if not args.declared:
        if args.report_only:
            return None
        raise SystemExit("arms run only under a declared design: --declared "
                         "bench/declared/<name>.json, committed before its first run "
                         "(bench/README.md)")
    design = {"bench": "arpo_vs_grpo", "run": str(src), "arms": arms, "seeds": seeds,
              "budget": args.tool_calls, "curve_every": args.curve_every,
              "eval": [args.eval_limit, args.eval_k], "target_gain": args.target_gain,
              "overrides": args.overrides}
    spec = declared.prepare(Path(args.declared), REPO, KNOWN_ARMS, design, Path(args.out),
                            args.underpowered, args.report_only)
    print(spec["power"]["line"], flush=True)
    print(f"declared {spec['where']['path']} (commit {spec['where']['commit'][:12]}): primary "
          f"{spec['primary']['name']}, {'-'.join(spec['primary']['contrast'])}", flush=True)
    return spec


def main() -> int:
    args = parse_args()
    from arpo_async.core.config import load_config
    from arpo_async.jobs.pipeline import USER_CONFIG
    from toolenv.retriever_server import RetrieverProcess
    from toolenv.tasks.suite import suite_noise

    src = Path(args.run)
    sft = src / "sft"
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a for a in args.arms.split(",") if a.strip()]
    spec = declare_run(args, src, seeds, arms)  # refuses before anything runs
    if not (src / USER_CONFIG).is_file() or not (sft / "config.json").is_file():
        raise SystemExit(f"--run {src}: needs a finished default job ({USER_CONFIG} and sft/); "
                         "see this script's docstring")
    for arm in arms:
        arm_overrides(arm, 0.5)  # names checked before anything runs
    if any(a in arms for a in MATCHED) and "arpo" not in arms:
        raise SystemExit("--arms: the random arms take their rates from the arpo arm; add arpo")
    base = load_config(src / USER_CONFIG, args.overrides)
    data_dir = Path(base.pipeline.data_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # arms already finished there are kept
    t0 = time.time()
    null = null_test(base, sft, data_dir, args) if args.null_limit else None
    rows: list[dict] = []
    corpus = data_dir / "corpus.jsonl"
    with RetrieverProcess(corpus, **suite_noise(corpus)) as retriever:
        sft_figures = sft_point(base, args, sft, retriever.url, out)
        for i, seed in enumerate(seeds):
            run_seed(i, seed, arms, base, args, sft, retriever.url, out, rows,
                     len(seeds) * len(arms), t0)
    add_calls_to_target(rows, sft_figures["pass@1"], args.target_gain, args.tool_calls)
    summary = summarize(rows)
    pairs = {f: paired(rows, f) for f in ("accuracy", "recovery", "pass@k")}
    report(summary, pairs, sft_figures, null, args, rows)
    png = plot(summary, sft_figures["pass@1"], Path(args.results).with_suffix(".png"))
    bands = curve_bands(rows, sft_figures["pass@1"], args.curve_every) if args.curve_every else {}
    if bands:
        curve_png = png.with_name(png.stem + "_curve.png")
        print(f"wrote {plot_curves(bands, sft_figures['pass@1'], args.target_gain, curve_png)}")
    print(f"wrote {png}")
    result = declared.evaluate(spec, rows) if spec else None
    if result:
        print("\n".join(declared.report_lines(result)))
        print(f"wrote {declared.write_result(out, spec, result)}")
    write_results("arpo_vs_grpo", {"args": vars(args), "declared": spec, "result": result,
                                   "sft": sft_figures, "suite": suite_noise(corpus),
                                   "rows": rows, "summary": summary, "paired": pairs,
                                   "curves": bands, "null_test": null,
                                   "wall_s": round(time.time() - t0, 1)}, args.results)
    print(verdict_line(summary, pairs, args, spec, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
