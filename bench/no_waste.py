"""Nothing generated thrown away (issue 31): the default job's RL stage with and without
the learner's straggler wait, and with the KV cache kept across weight updates, from one
SFT checkpoint; and the generation pause and context prefilled again per update.

Each arm is the RL stage of the default job (configs/default.yaml: two vLLM actors, the
DeepSpeed learner, sandboxed Python, the BM25 retriever) for ``--steps`` learner steps on
the same SFT model, followed by its held-out evaluation:

- ``wait``: this code's default, ``learner.straggler_wait_s = 300``: before a step that
  would make a group still out too old to train, the learner waits for it and trains the
  oldest groups first (learner/service.py ``collect``);
- ``nowait``: ``learner.straggler_wait_s = 0``: groups that arrive past the staleness
  bound are dropped, as before;
- ``keep``: the straggler wait and ``actors.update_mode = keep``: at a weight update the
  requests in flight are frozen with their KV cache and resumed on it (``wait`` and
  ``nowait`` interrupt them and prefill their context again).

Per arm, from its summary.json: groups received, dropped as stale and at the end;
``dropped_stale_share`` = stale / received; the token ledger (learner/tokens.py): model
tokens received and trained, ``token_yield`` = trained / received, the KS distance of the
trained vs received group lengths; the seconds the learner waited for stragglers; the RL
wall time and mean step time; held-out accuracy before and after RL (pass@1). The last
line is ``RESULT no_waste dropped_stale_share=<first arm> token_yield=<first arm>
keep_pause_vs_load=<x> recomputed_prefill_per_update=<n>
target=dropped_stale_share<=0.01,token_yield>=0.98 met|missed``. The last two come from
``--pause-updates`` updates per mode of bench/broadcast.py's pause measurement
(``pause_per_update``: one vLLM engine, 16 requests of 256 tokens in flight, interrupt and
keep in turn): keep's generation pause over the load alone, and the context tokens keep
prefills again per update (interrupt's are printed next to it).

    python bench/no_waste.py --model runs/default/sft [--steps 87]
        [--arms wait,nowait,keep] [--pause-updates 6] [--fresh] [key=value ...]

``--model`` is a finished default job's SFT folder (``python -m arpo_async.launch`` first).
An arm whose folder under ``--scratch`` holds a finished summary.json is read back, not run
again (``--fresh`` runs it again): a long bench resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, SCRATCH_DIR, write_results

ARMS = {"wait": ["actors.update_mode=interrupt"],
        "nowait": ["learner.straggler_wait_s=0", "actors.update_mode=interrupt"],
        "keep": ["actors.update_mode=keep"]}
TARGET_STALE, TARGET_YIELD = 0.01, 0.98


def run_arm(arm: str, model: Path, steps: int, scratch: Path, extra: list[str],
            fresh: bool) -> dict:
    run_dir = scratch / arm
    summary_path = run_dir / "summary.json"
    if summary_path.exists() and not fresh:
        summary = json.loads(summary_path.read_text())
        if summary.get("status") == "ok":
            print(f"[{arm}] read back from {run_dir}", flush=True)
            return summary
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "arpo_async.launch", "--quiet", f"run.dir={run_dir}",
           "pipeline.sft=false", f"model.path={model}", f"learner.max_steps={steps}",
           "run.time_limit_s=100000", *ARMS[arm], *extra]
    print(f"[{arm}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    log = (scratch / f"{arm}.log").open("w")
    proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"[{arm}] the run failed (exit {proc.returncode}): see "
                         f"{scratch / f'{arm}.log'}")
    print(f"[{arm}] done in {time.time() - t0:.0f} s", flush=True)
    return json.loads(summary_path.read_text())


def figures(summary: dict) -> dict:
    ledger = summary["ledger"].values()
    received = sum(led["received"] for led in ledger)
    stale = sum(led["dropped"].get("stale", 0) for led in ledger)
    shutdown = sum(led["dropped"].get("shutdown", 0) for led in ledger)
    tokens = summary.get("tokens", {})
    learner = summary.get("learner", {})
    return {
        "groups_received": received, "groups_trained": sum(led["trained"] for led in ledger),
        "groups_dropped_stale": stale, "groups_dropped_shutdown": shutdown,
        "dropped_stale_share": stale / received if received else 0.0,
        "tokens_received": tokens.get("received"), "tokens_trained": tokens.get("trained"),
        "tokens_dropped": tokens.get("dropped"), "token_yield": tokens.get("yield"),
        "ks_run": tokens.get("ks_run"),
        "straggler_wait_s": learner.get("straggler_wait_s"),
        "straggler_wait_expired": learner.get("events", {}).get("straggler_wait_expired", 0),
        "lag_hist": learner.get("staleness", {}).get("lag_hist"),
        "lag_max_trained": learner.get("staleness", {}).get("lag_max"),
        "rl_wall_s": summary.get("rl", {}).get("rl_wall_s"),
        "step_time_s_mean": summary.get("step_time_s_mean"),
        "accuracy_after_sft": summary.get("accuracy_after_sft"),
        "accuracy_after_rl": summary.get("accuracy_after_rl"),
        # the engines' prompt tokens per token sampled, and the context prefilled again
        "prefill": tokens.get("prefill"),
    }


def pause_figures(updates: int) -> dict:
    """bench/broadcast.py's pause measurement, interrupt against keep."""
    import asyncio

    from broadcast import pause_per_update, print_pauses
    from common import ensure_tiny

    model = str(ensure_tiny(f"{SCRATCH_DIR}/model_h512_l3", 512, 3))
    pause = asyncio.run(pause_per_update(model, updates, 256, ("interrupt", "keep")))
    print_pauses(pause)
    return pause


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a finished default job's SFT folder")
    ap.add_argument("--steps", type=int, default=87)
    ap.add_argument("--arms", default="wait,nowait,keep")
    ap.add_argument("--pause-updates", type=int, default=6,
                    help="weight updates per mode for the pause figures (0: skip them)")
    ap.add_argument("--scratch", default=f"{SCRATCH_DIR}/no_waste")
    ap.add_argument("--fresh", action="store_true", help="run finished arms again")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value for every arm")
    args = ap.parse_args()
    model = Path(args.model).resolve()
    if not (model / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there; give a finished default "
                         "job's SFT folder, e.g. runs/default/sft")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {sorted(ARMS)}")
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in arms:
        results[arm] = figures(run_arm(arm, model, args.steps, scratch, args.overrides,
                                       args.fresh))
        print(f"[{arm}] " + json.dumps(results[arm]), flush=True)
    pause = pause_figures(args.pause_updates) if args.pause_updates > 0 else None
    write_results("no_waste", {"model": str(model), "steps": args.steps, "arms": results,
                               "pause": pause}, args.out)
    head = results[arms[0]]
    met = head["dropped_stale_share"] <= TARGET_STALE and \
        (head["token_yield"] or 0) >= TARGET_YIELD
    keep = (f"keep_pause_vs_load={pause['keep']['pause_vs_load']:.2f} "
            f"recomputed_prefill_per_update={pause['keep']['median']['recomputed_tokens']:.0f}"
            if pause else "keep_pause_vs_load=n/a recomputed_prefill_per_update=n/a")
    if pause:
        print(f"context prefilled again per update: keep "
              f"{pause['keep']['median']['recomputed_tokens']:.0f} tokens, interrupt "
              f"{pause['interrupt']['median']['recomputed_tokens']:.0f}")
    print(f"RESULT no_waste dropped_stale_share={head['dropped_stale_share']:.4f} "
          f"token_yield={head['token_yield'] or 0:.4f} {keep} "
          f"target=dropped_stale_share<={TARGET_STALE},token_yield>={TARGET_YIELD} "
          f"{'met' if met else 'missed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
