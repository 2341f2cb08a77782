"""ARPO's premise, tested on outcomes: do forks placed by entropy land where another
continuation ends differently?

``python -m arpo_async.jobs.analyze branching RUN_DIR`` (or ``--model DIR --data FILE
[--corpus FILE]``, inputs as ``analyze entropy`` resolves them). For each of ``--limit``
prompts the real rollout (the run's engine, tools, estimator, window, alpha and beta; a
local retriever over the suite's corpus) samples K global samples (``--k``, GRPO). At
every branch decision of the first ``--roots`` of them, i.e. every round that follows a
tool result, the rollout's own fork mechanics (``LivePath.fork``: the tokens up to and
including the result, a copy of the tool state) start K continuations that run to the end
with the real tools and are scored by the task's reward. Per state: dH and
P = clip(alpha + beta * dH, 0, 1) exactly as the rollout computed them for the sampled
trajectory (a ``short_round=skip`` state gets P = 0: no fork), the reward discordance D of
its K continuations, the tool called and the result's kind (``result_kind``). The math
(discordance, the useful-fork ratio, fork_vs_global, the bootstrap over prompts,
correlations) is ``arpo_async/jobs/premise_stats.py``.

Deliberate simplifications: forks are made only from the sampled trajectories (a fork's
own later states are not probed); in AEPO runs the consecutive-branch penalty is left out
(P is ARPO's); D is measured among the K continuations, not against the sampled
trajectory's own continuation (whose first round set P).

Resumable: each finished prompt is one line of ``OUT/branching_prompts.jsonl`` (after a
header with the settings); a rerun with the same settings skips those prompts, another
setting starts the file again. Writes ``OUT/branching.json`` and prints one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import sys
import weakref
from pathlib import Path

import numpy as np

from actors.rollout import GRPOPolicy, Spawn
from arpo_async.core.config import Config, ConfigError
from arpo_async.core.entropy import round_entropy
from arpo_async.core.files import atomic_write_json
from arpo_async.jobs.premise_stats import correlation_by, discordance, pearson, premise_figures
from arpo_async.jobs.screen_stats import screen, screen_table, states_from_records
from toolenv.tasks.data import DataError

PROMPTS_FILE = "branching_prompts.jsonl"
_ENTITY = re.compile(r"((?:[A-Z][\w'-]*\s+)*[A-Z][\w'-]*)\W*$")  # a query's trailing name


def result_kind(tool: str | None, args: str, ok: bool | None, text: str) -> str:
    """What a tool result was: ``error`` (the call failed: an exception, a timeout, a bad
    call); for search, ``asked_entity`` when the result names the entity the query ends
    with (its trailing capitalised words, as the suite's queries do), ``other_entity``
    when it does not, ``no_entity`` for a query without one; else ``ok``."""
    if ok is None:
        return "unknown"
    if not ok:
        return "error"
    if tool == "search":
        m = _ENTITY.search(args.strip())
        if not m:
            return "no_entity"
        return "asked_entity" if m.group(1).lower() in text.lower() else "other_entity"
    return "ok"


class WindowRecorder:
    """The engine, passed through, keeping each asyncio task's last request length and
    result: a trajectory is one task, and its branch decision (``tool_round``) follows
    its round's ``generate`` in that task, so the round read there is its own."""

    def __init__(self, engine):
        self.engine = engine
        self.last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, req):
        res = await self.engine.generate(req)
        self.last[asyncio.current_task()] = (len(req.prompt_tokens), res)
        return res

    def round_of(self, context_len: int):
        """This task's last result if its request's context had ``context_len`` tokens."""
        got = self.last.get(asyncio.current_task())
        return got[1] if got and got[0] == context_len else None


def window_max_entropy(res, estimator: str, vocab: int, window: int) -> float:
    """The window's largest single-token entropy, normalised as the rollout normalises:
    ``round_entropy`` with ``reduce="max"`` (what ``rollout.entropy_reduce=max`` reads);
    the ``reference`` estimator ignores ``reduce``, so there it is the largest of its
    per-token values (``round_entropy`` of each token alone). nan: unknown."""
    if res is None:
        return math.nan
    if estimator == "reference":
        per = [round_entropy([t], [s], [], estimator=estimator, vocab_size=vocab, window=1)
               for t, s in zip(res.top_logprobs[:window], res.logprobs[:window]) if len(t)]
        return float(max(per)) if per else math.nan
    return round_entropy(res.top_logprobs, res.logprobs, res.entropies, estimator=estimator,
                         vocab_size=vocab, window=window, reduce="max")


class ProbePolicy(GRPOPolicy):
    """GRPO sampling of the roots, plus ``forks`` forks at every decision of the first
    ``probed`` roots, whatever P says; the decision metrics (P, dH as the rollout computed
    them, the call index, h_max) are kept in ``probed_decisions``, each tool result in
    ``tool_log`` by (trajectory, length after the result). ``window_max(at)`` gives the
    decision round's h_max (nan when unknown)."""

    def __init__(self, cfg, rng: np.random.Generator, forks: int, probed: int,
                 window_max=None):
        super().__init__(cfg, rng)
        if self.settings.branching:
            raise ValueError("ProbePolicy needs rollout.mode=grpo: it places the forks itself")
        self.forks, self.probed = forks, probed
        self.window_max = window_max or (lambda at: math.nan)
        self.probed_decisions: list[dict] = []
        self.tool_log: dict[tuple[int, int], tuple] = {}
        self.calls_of: dict[int, int] = {}  # tool calls each trajectory ran itself so far

    def tool_round(self, tid: int, at: int, h: float, short: bool) -> Spawn:
        forks, metrics = self.planner.after_tool_round(tid, h, short)
        if self.parent_of(tid) != -1 or tid >= self.probed:
            return Spawn(forks=forks)
        s = self.settings
        inherited = self.planner.h_init_of(tid) if s.fork_h_init == "parent" else None
        ids = [self.planner._create(tid, inherited, 0) for _ in range(self.forks)]
        self.probed_decisions.append({"root": tid, **metrics, "forks": ids,
                                      "call_index": self.calls_of.get(tid, 0),
                                      "h_max": self.window_max(at)})
        return Spawn(forks=ids)

    def finished(self, tid: int) -> list[int]:
        self.planner.finish(tid)
        return []  # the roots are all the global samples; forks never count against them

    def observe_tool(self, tid: int, at: int, call, result) -> None:
        self.calls_of[tid] = self.calls_of.get(tid, 0) + 1
        self.tool_log[(tid, at)] = (call.name, call.args, result_kind(
            call.name, call.args, result.ok, result.text))


async def probe(cfg: Config, engine, source, tokenizer, tools, rng, prompt, forks: int,
                probed: int) -> tuple[list, list[dict], dict]:
    """One prompt through the real rollout under a ``ProbePolicy``: (leaves by trajectory
    id, the probed decisions, the tool log)."""
    from actors.rollout import build_rollout

    policies = []
    recorder, r, vocab = WindowRecorder(engine), cfg.rollout, len(tokenizer)

    def window_max(at: int) -> float:
        res = recorder.round_of(len(prompt.tokens) + at)
        return window_max_entropy(res, r.entropy_estimator, vocab, r.entropy_window)

    def policy(rollout_cfg, rng):
        policies.append(ProbePolicy(rollout_cfg, rng, forks, probed, window_max))
        return policies[-1]

    group = await build_rollout(cfg, recorder, source, tokenizer, tools, rng, policy).run(
        prompt, 0)
    return group.leaves, policies[0].probed_decisions, policies[0].tool_log


def prompt_record(index: int, prompt_id, leaves: list, decisions: list[dict],
                  tool_log: dict) -> dict:
    """One prompt's line: the roots' rewards and tool calls (global samples) and each
    probed state: ``call_index`` is 1-based (the state follows the result of the
    trajectory's n-th tool call; with parallel calls, the turn's last), ``calls`` per
    continuation the tool calls it ran after the fork."""
    states = []
    for d in decisions:
        forks = [leaves[i] for i in d["forks"]]
        pos = int(forks[0].branch_point)
        tool, args, kind = tool_log.get((d["root"], pos), (None, "", "unknown"))
        skipped = bool(d.get("skipped_short", 0.0))
        known = math.isfinite(d["h_t"]) and math.isfinite(d["h_init"])  # else P used dH = 0
        n_call = int(d.get("call_index", 0))
        states.append({"root": d["root"], "position": pos, "tool": tool, "args": args,
                       "kind": kind, "call_index": n_call, "h_max": d.get("h_max", math.nan),
                       "p": 0.0 if skipped else d["p"],
                       "dh": d["dh"] if known and not skipped else math.nan, "h_t": d["h_t"],
                       "h_init": d["h_init"], "skipped_short": skipped,
                       "rewards": [float(f.reward) for f in forks],
                       "calls": [int(f.tool_calls) - n_call for f in forks],
                       "root_reward": float(leaves[d["root"]].reward)})
    roots = [x for x in leaves if x.parent == -1]
    return {"index": index, "prompt_id": str(prompt_id),
            "global": [float(x.reward) for x in roots],
            "global_calls": [int(x.tool_calls) for x in roots], "states": states}


async def probe_prompts(cfg: Config, engine, source, tokenizer, tools, prompts: list, k: int,
                        roots: int, seed: int, resume: Path | None = None,
                        settings: dict | None = None, concurrency: int = 8,
                        log=print) -> list[dict]:
    """Records of ``prompts`` (index = position in the list); with ``resume``, prompts
    already in that JSONL under the same ``settings`` are read back, new ones appended.
    Prompt i's rollout draws from ``default_rng([seed, i])``, so a prompt does not depend
    on the others or on a resume; within a prompt, tool latencies order the draws of its
    concurrent trajectories (an instant tool, as in the tests, makes reruns identical)."""
    done = _read_done(resume, settings) if resume else {}
    slots = asyncio.Semaphore(concurrency)
    out = dict(done)

    async def one(i: int, prompt) -> None:
        async with slots:
            leaves, decisions, tool_log = await probe(
                cfg, engine, source, tokenizer, tools, np.random.default_rng([seed, i]),
                prompt, k, roots)
        out[i] = prompt_record(i, prompt.id, leaves, decisions, tool_log)
        if resume:
            with resume.open("a") as fh:
                fh.write(json.dumps(out[i]) + "\n")
        log(f"[branching] prompt {i}: {len(decisions)} states ({len(out)}/{len(prompts)})")

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts) if i not in done))
    return [out[i] for i in sorted(out) if i < len(prompts)]


def _read_done(path: Path, settings: dict | None) -> dict[int, dict]:
    """Prompts finished under ``settings``; otherwise the file starts again."""
    header = {"settings": settings}
    if path.is_file():
        text = path.read_text()
        lines = text.splitlines()
        if lines and _parse(lines[0]) == json.loads(json.dumps(header)):
            recs = [r for r in map(_parse, lines[1:]) if r]  # a line cut by a kill: redone
            if not text.endswith("\n"):
                with path.open("a") as fh:
                    fh.write("\n")  # the next record starts on a line of its own
            return {r["index"]: r for r in recs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(header) + "\n")
    return {}


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def summarize(records: list[dict], seed: int = 0, n_boot: int = 2000, level: float = 0.9
              ) -> dict:
    """The premise figures (``premise_stats``) and correlations by tool and result kind."""
    clusters, dh_by_cluster, rows = [], [], []
    for rec in sorted(records, key=lambda r: r["index"]):
        g, _ = discordance(rec["global"])
        d = [discordance(s["rewards"])[0] for s in rec["states"]]
        clusters.append(([s["p"] for s in rec["states"]], d, g))
        dh_by_cluster.append([s["dh"] for s in rec["states"]])
        rows += [{**s, "d": dv} for s, dv in zip(rec["states"], d)]
    figures, metrics = premise_figures(clusters, np.random.default_rng([seed, 29]), n_boot,
                                       level)
    dh, d = [r["dh"] for r in rows], [r["d"] for r in rows]
    top = top_third(clusters, dh_by_cluster, seed, n_boot, level)
    by_tool, _ = correlation_by([str(r["tool"]) for r in rows], dh, d)
    by_kind, _ = correlation_by([f"{r['tool']}:{r['kind']}" for r in rows], dh, d)
    for table, key in ((by_tool, lambda r: str(r["tool"])),
                       (by_kind, lambda r: f"{r['tool']}:{r['kind']}")):
        for name, cell in table.items():
            mine = [r for r in rows if key(r) == name]
            cell.update(p_mean=_mean([r["p"] for r in mine]), d_mean=_mean([r["d"] for r in mine]),
                        dh_mean=_mean([r["dh"] for r in mine]))
    r_all, m_all = pearson(dh, d)
    return {**figures, **metrics, **top, "corr_dh_d": r_all, "corr_n": m_all["n"],
            "corr_by_tool": by_tool, "corr_by_kind": by_kind,
            "skipped_short": sum(r["skipped_short"] for r in rows),
            **rules_screen(records, seed, level)}


def rules_screen(records: list[dict], seed: int = 0, level: float = 0.9,
                 n_perm: int = 2000) -> dict:
    """Every placement rule on the same probed states (``screen_stats``): ``screen``
    {rule: figures}, and ``screen_missing``, the fields an older prober did not record."""
    states, m_states = states_from_records(records)
    rules, m_screen = screen(states, np.random.default_rng([seed, 31]), n_perm, level)
    return {"screen": rules, "screen_missing": m_states["missing"],
            "screen_stratum": m_screen["stratum"]}


def screen_lines(res: dict) -> list[str]:
    """The rules table of a summary, with a note when an older run lacks fields."""
    lines = ["every rule on the same states (ratio vs random; diff vs arpo; within-prompt "
             "permutation p; discordance per tool call vs fresh samples):",
             *screen_table(res["screen"])]
    if res["screen_missing"]:
        lines.append(f"  (this run's records lack {', '.join(res['screen_missing'])}: "
                     "rerun the prober for the rules that need them)")
    return lines


def top_third(clusters: list[tuple], dh_by_cluster: list[list[float]], seed: int,
              n_boot: int, level: float) -> dict:
    """The useful-fork ratio of the sharpest allocation entropy allows: fork at every state
    whose dH is in the top third of all states' (P = 1 there, 0 elsewhere). ARPO's P =
    alpha + beta dH (0.5 + 0.2 dH) barely varies with dH, so its own ratio stays near 1
    whatever dH says; this one reaches the ratio that dH's ranking can give at all."""
    finite = [x for dh in dh_by_cluster for x in dh if math.isfinite(x)]
    if not finite:
        return {"top_third_ratio": math.nan, "top_ci_low": math.nan, "top_ci_high": math.nan}
    cut = float(np.quantile(finite, 2 / 3))
    top = [([1.0 if math.isfinite(x) and x >= cut else 0.0 for x in dh], d, g)
           for (_, d, g), dh in zip(clusters, dh_by_cluster)]
    fig, _ = premise_figures(top, np.random.default_rng([seed, 30]), n_boot, level)
    return {"top_third_ratio": fig["useful_fork_ratio"], "top_ci_low": fig["ci_low"],
            "top_ci_high": fig["ci_high"], "top_third_dh_cut": cut}


def _mean(values: list[float]) -> float:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else math.nan


def finding(res: dict) -> str:
    return (f"useful-fork ratio {res['useful_fork_ratio']:.3f} (90% CI {res['ci_low']:.3f}-"
            f"{res['ci_high']:.3f}) over {res['states']} post-tool states of {res['prompts']} "
            f"prompts; forking only at the top third of dH {res['top_third_ratio']:.3f} "
            f"({res['top_ci_low']:.3f}-{res['top_ci_high']:.3f}); fork_vs_global "
            f"{res['fork_vs_global']:.3f}; corr(dH, D) "
            f"{res['corr_dh_d']:.3f}; mean P {res['p_mean']:.3f}, mean D {res['d_mean']:.3f}")


# ----------------------------------------------------------------------------- the command


def branching_analysis(cfg: Config, data: Path, corpus: Path | None, out: Path, limit: int,
                       k: int, roots: int, seed: int = 0, n_boot: int = 2000,
                       log=print) -> dict:
    """The whole test on ``cfg.model.path``: sample, complete, score, summarise, write."""
    from actors.engines import build_engine
    from arpo_async.jobs.evaluate import analysis_prompts
    from toolenv.runner import build_tools

    if k < 2 or not 1 <= roots <= k:
        raise ConfigError(f"--k must be >= 2 and --roots in [1, k]; got k={k}, roots={roots}")
    r = cfg.rollout
    # version 2: records carry call_index, h_max, calls and global_calls; a file written by
    # version 1 starts again (its prompts lack what the rules screen needs)
    settings = {"version": 2, "model": cfg.model.path, "data": str(data), "k": k, "roots": roots,
                "seed": seed, "alpha": r.alpha, "beta": r.beta, "estimator": r.entropy_estimator,
                "window": r.entropy_window, "reduce": r.entropy_reduce,
                "short_round": r.short_round, "temperature": cfg.sampling.temperature}
    with contextlib.ExitStack() as stack:
        cfg, tok, source, prompts = analysis_prompts(stack, cfg, data, k, corpus, limit)
        tools = build_tools(cfg.tools, Path(cfg.run.dir))
        records = asyncio.run(_run(cfg, build_engine, source, tok, tools, prompts, k, roots,
                                   seed, out / PROMPTS_FILE, settings, log))
    result = {"settings": settings, **summarize(records, seed, n_boot)}
    result["finding"] = finding(result)
    atomic_write_json(out / "branching.json", result)
    return result


async def _run(cfg, build_engine, source, tok, tools, prompts, k, roots, seed, resume,
               settings, log) -> list[dict]:
    try:
        engine = await build_engine(cfg, cfg.model.path)
        try:
            return await probe_prompts(cfg, engine, source, tok, tools, prompts, k, roots,
                                       seed, resume, settings, log=log)
        finally:
            await engine.close()
    finally:
        await tools.close()


def add_parser(sub, input_args) -> None:
    """The ``branching`` subcommand of ``python -m arpo_async.jobs.analyze``;
    ``input_args`` adds the arguments its ``inputs`` (``run_command``) reads."""
    b = sub.add_parser("branching", help="outcome test: do entropy-placed forks change rewards?")
    input_args(b)
    b.add_argument("--limit", type=int, default=64, help="prompts")
    b.add_argument("--k", type=int, default=8, help="global samples per prompt and "
                   "continuations per post-tool state")
    b.add_argument("--roots", type=int, help="global samples whose states are probed (default K)")
    b.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed")
    b.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")


def run_command(args, inputs) -> int:
    """Run the parsed ``branching`` command; ``inputs`` resolves (cfg, data, corpus, out)."""
    try:
        cfg, data, corpus, out = inputs(args)
        res = branching_analysis(cfg, data, corpus, out, args.limit, args.k,
                                 args.roots or args.k, args.seed, args.boot)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'branching.json'}: {res['finding']}")
    print("\n".join(screen_lines(res)))
    return 0
