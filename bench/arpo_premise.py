"""ARPO's premise on a run's SFT model: do forks placed by entropy land where another
continuation ends differently? (issue 29, item 2)

Runs the outcome test of ``python -m arpo_async.jobs.analyze branching``
(arpo_async/jobs/analyze_branching.py, math in arpo_async/jobs/premise_stats.py) on the
SFT model of a finished default job: ``--prompts`` held-out prompts x ``--k`` global
samples through the real rollout (the run's engine, tools, estimator, alpha, beta; a local
retriever over the suite's corpus), and at every post-tool state of the first ``--roots``
samples, K continuations completed to the end with the real fork mechanics and tools,
each scored by the task's reward. Figures:

* **useful_fork_ratio** = (sum P D / sum P) / mean D over post-tool states (P the run's
  branch probability, D the share of continuation pairs whose rewards differ), with its
  90% bootstrap interval over prompts (ci_low, ci_high): above 1, entropy places forks
  where outcomes split more often than chance placement at the same rate would;
* **fork_vs_global**: mean D after tool results / D of the K fresh samples of the same
  prompt;
* **top_third**: the same ratio for the sharpest allocation dH allows (fork only at the
  states in the top third of dH): ARPO's own P (0.5 + 0.2 dH) varies so little that its
  ratio stays near 1 whatever dH says;
* corr(dH, D) overall, by tool and by tool-result kind (in the JSON);
* **the rules screen** (issue 53; arpo_async/jobs/screen_stats.py): every fork-placement
  rule (arpo, max_token, stratum, prompt_pq, random, oracle) scored on the same probed
  states: its ratio against random with a 90% Fieller interval, its paired difference
  from arpo, a within-prompt permutation p, and discordance per executed tool call
  against fresh global samples; printed as a table, in the JSON under ``screen``.

Target: ci_low > 1. Resumable: finished prompts are lines of
``OUT/branching_prompts.jsonl`` (default OUT = RUN/analysis), read back on a rerun with
the same settings. The last line is ``RESULT arpo_premise useful_fork_ratio=<x>
ci_low=<l> ci_high=<h> fork_vs_global=<y> top_third=<t> task=<name> model=<name>
target=ci_low>1 met|missed``; model is ``--model-name``, else ``smollm2`` when the run's
``model.build`` is, else the model folder's name (the run folder's for ``sft``).

    python bench/arpo_premise.py RUN_DIR [--prompts 64] [--k 8] [--roots K] [--model DIR]
        [--model-name NAME] [--seed 0] [--boot 2000] [--out DIR] [--results FILE]
        [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, write_results  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a finished run folder (config.yaml; sft/ when present)")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts")
    ap.add_argument("--k", type=int, default=8,
                    help="global samples per prompt and continuations per post-tool state")
    ap.add_argument("--roots", type=int, default=None,
                    help="global samples whose post-tool states are probed (default K)")
    ap.add_argument("--model", default=None, help="model (default RUN/sft, else the run's "
                    "newest checkpoint)")
    ap.add_argument("--model-name", default=None, help="name on the RESULT line (default: "
                    "smollm2 for a run built as smollm2, else the model folder's name)")
    ap.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed")
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--out", default=None, help="analysis folder (default RUN/analysis)")
    ap.add_argument("--results", default=str(RESULTS / "arpo_premise.json"))
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return ap.parse_intermixed_args(argv)  # key=value overrides may follow the options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from arpo_async.jobs.analyze import _inputs
    from arpo_async.jobs.analyze_branching import PROMPTS_FILE, branching_analysis, screen_lines

    run = Path(args.run_dir)
    sft = run / "sft"
    model = args.model or (str(sft) if (sft / "config.json").is_file() else None)
    spec = argparse.Namespace(run_dir=str(run), model=model, data=None, corpus=None,
                              config=None, out=args.out, overrides=args.overrides)
    cfg, data, corpus, out = _inputs(spec)
    done = out / PROMPTS_FILE
    resume = f"; finished prompts read back from {done}" if done.is_file() else ""
    print(f"[arpo_premise] model {cfg.model.path}, {args.prompts} prompts of {data}, "
          f"K {args.k}{resume}", flush=True)
    t0 = time.time()
    res = branching_analysis(cfg, data, corpus, out, args.prompts, args.k,
                             args.roots or args.k, args.seed, args.boot)
    wall = time.time() - t0
    print(res["finding"])
    for name, cell in {**res["corr_by_tool"], **res["corr_by_kind"]}.items():
        print(f"  {name:24} n {cell['n']:4d}  corr(dH, D) {cell['r']:+.3f}  mean P "
              f"{cell['p_mean']:.3f}  mean D {cell['d_mean']:.3f}")
    print("\n".join(screen_lines(res)))
    task = data.parent.name or cfg.task.name
    name = args.model_name or model_name(cfg.model.build, cfg.model.path, run)
    write_results("arpo_premise", {"args": vars(args), "task": task, "model": name,
                                   "wall_s": round(wall, 1),
                                   "analysis": str(out / "branching.json"), **res},
                  args.results)
    low = res["ci_low"]
    met = "met" if low > 1 else "missed"  # nan compares false: missed
    print(f"RESULT arpo_premise useful_fork_ratio={res['useful_fork_ratio']:.3f} "
          f"ci_low={low:.3f} ci_high={res['ci_high']:.3f} "
          f"fork_vs_global={res['fork_vs_global']:.3f} top_third={res['top_third_ratio']:.3f} "
          f"task={task} model={name} target=ci_low>1 {met}")
    return 0


def model_name(build: str, model_path: str, run: Path) -> str:
    """``smollm2`` for a run that builds it; else the model folder's name, the run's for
    its ``sft`` folder."""
    if build == "smollm2":
        return "smollm2"
    folder = Path(model_path).resolve()
    return run.resolve().name if folder.name == "sft" else folder.name


if __name__ == "__main__":
    sys.exit(main())
