"""ARPO's premise, measured on your model: does entropy rise right after a tool result?

``python -m arpo_async.jobs.analyze entropy RUN_DIR`` (or ``--model DIR --data FILE
[--corpus FILE]``) samples trajectories with tools through the real rollout (GRPO
sampling, the run's tools; a local retriever over the suite's corpus), then computes the
exact per-token entropy of every model token with a learner-side forward pass
(transformers, full vocabulary, at the sampling temperature, divided by ln V), and
reports the mean normalised entropy

* at each of the k model tokens before a tool call (the end of the round that calls it),
* at each of the first k model tokens after its result (the round ARPO decides on),
* over the first k tokens of the first round (the baseline H_init), and by round index
  and by tool.

It also scores the rollout's own estimate: the tail-corrected top-``sampling.logprobs_topk``
entropy against the exact one, as the error on the round entropy H and on dH = H_t - H_init
with ``rollout.entropy_reduce``.

**The null test** (``null_test``, arpo_async/jobs/analyze_null.py and null_stats.py):
each branch decision the samples hold (dH = H of a round after a tool result - H of the
trajectory's first round) against its own noise. The engine samples the decision's k-token
window ``--resample`` times (default 8) again at the decision's prefix (the same tokens up
to and including the tool result), with the rollout's stops and round limit; every
window is scored by the same forward pass. For each estimator of
``rollout.entropy_estimator`` (the authors' ``reference`` at their top 10,
``tail_corrected`` at the run's top k, ``exact``) and each ``rollout.short_round`` rule it
reports the real decisions (dH, the share of P = alpha + beta * dH outside [0.45, 0.55]),
signal/noise = var(dH) / (mean var(H_post | prefix) + var(H_init | prompt), the latter
pooled over the prompt's trajectories that made a decision: ``--k`` 2 or more), 1 when
the decisions are sampling noise only, the same over the post-tool window's noise alone
(``signal_to_noise_post_only``), each with a 90% bootstrap interval over prompts, and the
std of P that resampling alone gives at a fixed state (``p_noise_std``). It replaces a null
of other samples' first rounds, which read S/N 29 where the decision's own resampling
reads 3.4 (issue 29). Costs a generation and a forward pass per window (R per decision) on
top of one forward pass per trajectory.

Writes ``RUN_DIR/analysis/entropy.json`` (keys ``before_tool``, ``after_tool``,
``first_round``, ``n_tool_calls``, ``by_round``, ``by_tool``, ``estimate``, ``null_test``,
``finding``)
and ``RUN_DIR/analysis/entropy_by_position.png`` (the ARPO paper's motivating figure, for
this model), and prints the finding in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
from pathlib import Path

import numpy as np

from actors.engines import build_engine
from arpo_async.core.config import Config, ConfigError, load_config
from arpo_async.core.entropy import entropy_from_logits, entropy_from_topk, window_entropy
from arpo_async.core.files import atomic_write_json
from arpo_async.core.rundir import latest_checkpoint
from arpo_async.jobs.analyze_null import (
    AUTHORS_TOPK,
    null_line,
    null_test,
    resample_windows,
    rounds_of,
    window_request,
    windows_of,
)
from arpo_async.jobs.evaluate import analysis_prompts
from toolenv.runner import build_tools
from toolenv.tasks.data import DataError


def position_profile(leaves: list[dict], k: int) -> dict:
    """Mean exact entropy by position around tool calls, from per-leaf records
    (``entropy``: per response token, nan for tool tokens; ``mask``; ``tools``: the tool
    each round called, None for the last)."""
    before = [[] for _ in range(k)]  # before[j]: the (k - j)-th token before the call
    after = [[] for _ in range(k)]
    first, by_round, by_tool = [], {}, {}
    calls = 0
    for leaf in leaves:
        ent, rounds = leaf["entropy"], rounds_of(leaf["mask"])
        for r, (s, e) in enumerate(rounds):
            head = ent[s:min(e, s + k)]
            by_round.setdefault(r, []).append(float(np.mean(head)))
            if r == 0:
                first.append(float(np.mean(head)))
            tool = leaf["tools"][r] if r < len(leaf["tools"]) else None
            if tool is None or r + 1 >= len(rounds):
                continue  # no call, or the call's result ended the trajectory
            calls += 1
            tail = ent[max(s, e - k):e]
            for j, v in enumerate(tail[::-1]):
                before[k - 1 - j].append(float(v))
            s2, e2 = rounds[r + 1]
            nxt = ent[s2:min(e2, s2 + k)]
            for j, v in enumerate(nxt):
                after[j].append(float(v))
            by_tool.setdefault(tool, []).append(float(np.mean(nxt)))

    def means(cols):
        return [float(np.mean(c)) if c else None for c in cols]

    flat = lambda cols: [v for c in cols for v in c]  # noqa: E731
    return {"before_tool": {"by_position": means(before), "mean": _mean(flat(before))},
            "after_tool": {"by_position": means(after), "mean": _mean(flat(after))},
            "first_round": {"mean": _mean(first), "n": len(first)},
            "by_round": {str(r): _mean(v) for r, v in sorted(by_round.items())},
            "by_tool": {t: {"after_mean": _mean(v), "n": len(v)} for t, v in by_tool.items()},
            "n_tool_calls": calls}


def vocab_of(cfg: Config) -> int:
    """V of the rollout's normalisation (``len(tokenizer)``, as AgentRollout uses)."""
    from transformers import AutoTokenizer  # transformers: heavy, not for --help

    return len(AutoTokenizer.from_pretrained(cfg.model.path))


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def finding(profile: dict) -> str:
    b, a = profile["before_tool"]["mean"], profile["after_tool"]["mean"]
    h0 = profile["first_round"]["mean"]
    if b is None or a is None:
        return "no tool call was followed by another round: nothing to compare"
    word = "rises" if a > b else "does not rise"
    return (f"entropy {word} after tool results for this model: {a:.3f} in the first "
            f"tokens after a result vs {b:.3f} before the call ({a - b:+.3f}, "
            f"{(a / b - 1) * 100 if b else float('nan'):+.0f}%); first round {h0:.3f}; "
            f"{profile['n_tool_calls']} tool calls")


# ----------------------------------------------------------------------------- sampling


async def sample_leaves(cfg: Config, data: Path, limit: int, k: int, corpus: Path | None,
                        log=print, resample: int = 0) -> list[dict]:
    """Trajectories of ``limit`` prompts x ``k`` samples through the real rollout, as
    records: prompt ids, response ids, loss mask and the tool each round called; with
    ``resample`` R, each decision's and each prompt's window resampled R times by the same
    engine (``analyze_null.resample_windows``), before the engine is closed."""
    from actors.rollout import POLICIES, build_rollout

    with contextlib.ExitStack() as stack:
        cfg, tok, source, prompts = analysis_prompts(stack, cfg, data, k, corpus, limit)
        tools = build_tools(cfg.tools, Path(cfg.run.dir) / "analysis")
        engine = await build_engine(cfg, cfg.model.path)
        try:
            rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(0),
                                    POLICIES[cfg.rollout.mode])
            groups = await asyncio.gather(*(rollout.run(p, 0) for p in prompts))
            out = []
            for p, g in zip(prompts, groups):
                for leaf in g.leaves:
                    names = []
                    for s, e in rounds_of(leaf.loss_mask):
                        calls = source.syntax.find_calls(  # a turn's last call names it
                            tok.decode(leaf.tokens[s:e], skip_special_tokens=False))
                        names.append(calls[-1].name if calls else None)
                    out.append({"prompt": list(p.tokens), "tokens": leaf.tokens,
                                "mask": leaf.loss_mask, "tools": names})
            log(f"[analyze] sampled {len(out)} trajectories of {len(prompts)} prompts")
            if resample:
                n = await resample_windows(
                    engine, out, resample, cfg.rollout.entropy_window,
                    window_request(cfg, rollout.stepper.stop_ids, rollout.stepper.stop_strings),
                    cfg.run.seed)
                log(f"[analyze] resampled {n} windows for the null test")
        finally:
            await engine.close()
            await tools.close()
    return out


def score_entropies(model_path: str, leaves: list[dict], temperature: float,
                    topk: int) -> None:
    """Add to each record, per response token (nan on tool tokens): the exact normalised
    entropy (``entropy``) and in nats (``nats``), the tail-corrected top-k estimate
    (``estimate``), the top max(k, the authors' 10) log-probs (``top``) and the sampled
    token's log-prob (``sampled``)."""
    import torch  # torch: heavy, not for --help
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for leaf in leaves:
        ids = torch.tensor([leaf["prompt"] + [int(t) for t in leaf["tokens"]]])
        n, L = len(leaf["prompt"]), len(leaf["tokens"])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, n - 1:n + L - 1].float() / temperature
        exact = entropy_from_logits(logits).numpy().astype(np.float64)
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(max(topk, AUTHORS_TOPK), -1).values.numpy().astype(np.float64)
        est = entropy_from_topk(list(top[:, :topk]), logits.shape[-1])
        tool = np.asarray(leaf["mask"]) == 0
        exact[tool], est[tool] = np.nan, np.nan
        leaf["entropy"], leaf["estimate"], leaf["top"] = exact, est, top
        leaf["nats"] = exact * math.log(logits.shape[-1])
        leaf["sampled"] = logp.gather(-1, ids[0, n:n + L, None])[:, 0].numpy().astype(np.float64)


def estimate_error(leaves: list[dict], k: int, reduce: str) -> dict:
    """Mean absolute error of the top-k estimate on the round entropy H and on dH."""
    err_h, err_dh, dh_exact = [], [], []
    for leaf in leaves:
        rounds = rounds_of(leaf["mask"])
        if not rounds:
            continue
        h = [(window_entropy(leaf["entropy"][s:e], k, reduce),
              window_entropy(leaf["estimate"][s:e], k, reduce)) for s, e in rounds]
        err_h += [abs(a - b) for a, b in h]
        for a, b in h[1:]:  # rounds after a tool result: the branch decisions
            dh_exact.append(a - h[0][0])
            err_dh.append(abs((a - h[0][0]) - (b - h[0][1])))
    return {"reduce": reduce, "window": k, "h_mae": _mean(err_h), "dh_mae": _mean(err_dh),
            "dh_exact_mean_abs": _mean([abs(x) for x in dh_exact]), "decisions": len(err_dh)}


def plot(profile: dict, path: Path, k: int) -> Path:
    import matplotlib  # matplotlib: heavy; its backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, a = profile["before_tool"]["by_position"], profile["after_tool"]["by_position"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(range(-k, 0), [np.nan if v is None else v for v in b], "o-", label="before the call")
    ax.plot(range(1, k + 1), [np.nan if v is None else v for v in a], "o-",
            label="after the result")
    if profile["first_round"]["mean"] is not None:
        ax.axhline(profile["first_round"]["mean"], ls="--", c="gray", label="first round")
    ax.axvline(0, c="k", lw=0.8)
    ax.set_xlabel("model token position relative to the tool call / result")
    ax.set_ylabel("entropy / ln V")
    ax.set_title(f"{profile['n_tool_calls']} tool calls")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the command


def _input_args(p: argparse.ArgumentParser) -> None:
    """The arguments ``_inputs`` reads: a run folder, or a model and prompts."""
    p.add_argument("run_dir", nargs="?", help="a run folder: its newest checkpoint, held-out "
                   "prompts and corpus")
    p.add_argument("--model", help="model folder (default: the run's newest checkpoint)")
    p.add_argument("--data", help="prompts (JSONL/parquet; default: the suite's heldout.jsonl)")
    p.add_argument("--corpus", help="JSONL corpus for a local retriever (search)")
    p.add_argument("--config", help="YAML config without RUN_DIR (default configs/default.yaml)")
    p.add_argument("--out", help="output folder (default RUN_DIR/analysis)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def _inputs(args) -> tuple[Config, Path, Path | None, Path]:
    """(config with the model to analyse, prompts, corpus or None, output folder)."""
    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir}: no config.yaml (not a run folder)")
        cfg = load_config(run_dir / "config.yaml", args.overrides)
        ckpt = latest_checkpoint(run_dir)
        model = args.model or (str(ckpt) if ckpt else cfg.model.path)
        suite = Path(cfg.pipeline.data_dir)
        data = Path(args.data) if args.data else (
            suite / "heldout.jsonl" if (suite / "heldout.jsonl").is_file() else Path(cfg.task.data))
        corpus = args.corpus or (suite / "corpus.jsonl" if (suite / "corpus.jsonl").is_file()
                                 else None)
        out = Path(args.out) if args.out else run_dir / "analysis"
    else:
        if not (args.model and args.data):
            raise ConfigError("give RUN_DIR, or --model DIR and --data FILE")
        cfg = load_config(args.config, args.overrides)
        model, data, corpus = args.model, Path(args.data), args.corpus
        out = Path(args.out or "analysis")
    cfg.model.path = str(model)
    cfg.run.dir = str(out)
    if not data.is_file():
        raise ConfigError(f"--data: {data} does not exist")
    return cfg, data, Path(corpus) if corpus else None, out


def entropy_analysis(cfg: Config, data: Path, corpus: Path | None, out: Path, limit: int,
                     k_samples: int, resample: int = 8) -> dict:
    k = cfg.rollout.entropy_window
    leaves = asyncio.run(sample_leaves(cfg, data, limit, k_samples, corpus, resample=resample))
    # the resampled windows are scored by the same forward pass as the trajectories
    score_entropies(cfg.model.path, leaves + windows_of(leaves), cfg.sampling.temperature,
                    cfg.sampling.logprobs_topk)
    profile = position_profile(leaves, k)
    result = {"model": cfg.model.path, "data": str(data), "prompts": limit,
              "samples_per_prompt": k_samples, "window": k, "resampled_windows": resample,
              "temperature": cfg.sampling.temperature, **profile,
              "estimate": {
                  "kind": f"tail-corrected top-{cfg.sampling.logprobs_topk}",
                  "token_mae": _mean([float(np.nanmean(np.abs(x["entropy"] - x["estimate"])))
                                      for x in leaves if np.isfinite(x["entropy"]).any()]),
                  **{r: estimate_error(leaves, k, r) for r in ("sum", "mean")}},
              "null_test": null_test(leaves, k, cfg.sampling.logprobs_topk, vocab_of(cfg),
                                     cfg.rollout.alpha, cfg.rollout.beta)}
    result["finding"] = finding(profile) + "\n" + null_line(result["null_test"], resample)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "entropy.json", result)
    plot(profile, out / "entropy_by_position.png", k)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arpo_async.jobs.analyze",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("entropy", help="entropy by position around tool calls")
    _input_args(e)
    e.add_argument("--limit", type=int, default=48, help="prompts sampled")
    e.add_argument("--k", type=int, default=2, help="samples per prompt")
    e.add_argument("--resample", type=int, default=8, help="windows resampled at each "
                   "decision's prefix for the null test (at least 2)")
    t = sub.add_parser("trees", help="the learner's kept groups as one HTML page "
                       "(arpo_async/jobs/trees_page.py)")
    t.add_argument("run_dir", help="a run folder with trees/ (learner.trees_every)")
    t.add_argument("--out", help="the page (default RUN_DIR/analysis/trees.html)")
    from arpo_async.jobs.analyze_branching import add_parser, run_command  # outcome test

    add_parser(sub, _input_args)
    # key=value after an option (``RUN --k 4 rollout.alpha=0.3``): argparse leaves it over
    args, extra = ap.parse_known_args(argv)
    stray = [w for w in extra if w.startswith("-") or "=" not in w]
    if stray or (extra and not hasattr(args, "overrides")):
        ap.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.what == "trees":
        from arpo_async.jobs.trees_page import cli  # the page alone: no model, no engine

        return cli(args.run_dir, args.out)
    if args.run_dir and "=" in args.run_dir:  # no RUN_DIR: the first word is an override
        args.overrides.insert(0, args.run_dir)
        args.run_dir = None
    if args.what == "branching":
        return run_command(args, _inputs)
    try:
        cfg, data, corpus, out = _inputs(args)
        if args.resample < 2:
            raise ConfigError("--resample: at least 2 windows (a variance needs two)")
        result = entropy_analysis(cfg, data, corpus, out, args.limit, args.k, args.resample)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'entropy.json'} and {out / 'entropy_by_position.png'}")
    print(result["finding"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
