"""The default job, stage by stage: build the synthetic tool suite and the model, cold-start
SFT, evaluate, asynchronous RL (learner + actors through the supervisor), evaluate again,
summarise and plot. ``python -m arpo_async.launch`` runs it when ``pipeline.enabled``.

Stages and what each leaves in the run folder::

    data      pipeline.data_dir/{corpus,sft,rl,heldout}.jsonl, meta.json (built once, reused)
    model     model.path (the local tiny model, built when missing)
    sft       RUN_DIR/sft/                 Hugging Face checkpoint after cold-start SFT
    eval_sft  RUN_DIR/eval/sft/            summary.json + items.jsonl on the held-out split
    rl        RUN_DIR/checkpoints/, metrics.jsonl, ...  (arpo_async/launcher/supervisor.py)
    eval_rl   RUN_DIR/eval/rl/             the same evaluation of the newest RL checkpoint
    report    RUN_DIR/summary.json, RUN_DIR/plots/*.png

``RUN_DIR/pipeline.json`` records each finished stage (seconds, result) and is rewritten
atomically after each one, so ``launch --resume RUN_DIR`` skips what is done and the RL
stage continues from its newest checkpoint. One local retriever serves the suite's corpus
to the evaluations and the actors (a fresh one, on a new port, after a resume).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from arpo_async.core.config import Config, ConfigError, load_config, save_config
from arpo_async.core.files import atomic_write_bytes
from arpo_async.core.metrics import read_metrics, variance_summary, wandb_log_images
from arpo_async.core.rundir import latest_checkpoint
from arpo_async.jobs.evaluate import evaluate
from arpo_async.jobs.plots import write_plots
from arpo_async.jobs.preflight import check_lengths, check_packing, check_tools
from arpo_async.jobs.sft import run_sft
from arpo_async.jobs.synthetic import SuiteSpec, write_suite
from arpo_async.jobs.tiny_model import ensure_model
from arpo_async.launcher.supervisor import (LaunchRequest, checked, launch, resolve,
                                            with_ports)
from toolenv.retriever_server import RetrieverProcess
from toolenv.tasks.suite import suite_noise

STATE = "pipeline.json"
USER_CONFIG = "pipeline_config.yaml"  # the config as given, before stage overrides


def _say(text: str) -> None:
    print(f"[pipeline] {text}", flush=True)


class StageLog:
    """Finished stages of a run (``RUN_DIR/pipeline.json``), written after each stage."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / STATE
        self.state: dict[str, Any] = (json.loads(self.path.read_text())
                                      if self.path.exists() else {"stages": {}})

    def done(self, name: str) -> dict | None:
        return self.state["stages"].get(name)

    def record(self, name: str, seconds: float, result: dict) -> None:
        self.state["stages"][name] = {"seconds": round(seconds, 1), **result}
        self.save()

    def save(self) -> None:
        """Rewrite the file atomically, stages in the order they ran."""
        atomic_write_bytes(self.path, json.dumps(self.state, indent=1).encode())

    def run(self, name: str, fn, *args: Any) -> dict:
        """``fn(*args)`` unless ``name`` finished before; its result (a dict)."""
        if (prev := self.done(name)) is not None:
            _say(f"{name}: done before ({prev['seconds']} s), skipped")
            return prev
        _say(f"{name}: starting")
        t0 = time.perf_counter()
        result = fn(*args)
        self.record(name, time.perf_counter() - t0, result)
        _say(f"{name}: finished in {time.perf_counter() - t0:.0f} s")
        return self.state["stages"][name]


# ----------------------------------------------------------------------------- stages


def build_data(cfg: Config) -> dict:
    p = cfg.pipeline
    out = Path(p.data_dir)
    if cfg.task.name == "file" and Path(cfg.task.data).resolve().parent != out.resolve():
        raise ConfigError(f"task.data: {cfg.task.data} is not the RL split of pipeline.data_dir "
                          f"({out}/rl.jsonl)")
    h = p.suite_hard  # its dials only when on: the default suite's spec stays as it was
    dials = dict(hard=True, mix=dict(h.mix), namesakes=h.namesakes) if h.enabled else {}
    try:
        spec = SuiteSpec(seed=cfg.task.seed, entities=p.suite_entities, sft=p.suite_sft,
                         rl=p.suite_rl, heldout=p.suite_heldout, topk=cfg.tools.search.topk,
                         snippet_chars=cfg.tools.search.snippet_chars, direct=p.suite_direct,
                         search_noise=p.suite_noise, python_slips=p.suite_slips,
                         recover=p.suite_recover, search_noise_note=p.suite_noise_note,
                         **dials)
    except ValueError as exc:  # the harder suite's dials against tools.search.topk
        raise ConfigError(f"pipeline.suite_hard with tools.search.topk="
                          f"{cfg.tools.search.topk}: {exc}") from None
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        # a suite written before a spec field existed was built with its default
        if {**asdict(SuiteSpec()), **meta.get("spec", {})} == asdict(spec):
            return {"dir": str(out), "built": False, **meta["counts"]}
        raise ConfigError(f"pipeline.data_dir: {out} holds a suite built with {meta.get('spec')}, "
                          f"not {asdict(spec)}; remove it or point pipeline.data_dir elsewhere")
    meta = write_suite(out, spec)
    return {"dir": str(out), "built": True, **meta["counts"]}


def build_model(cfg: Config) -> dict:
    try:
        return {"path": str(ensure_model(cfg.model.path, cfg.model))}
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


def cold_start_sft(cfg: Config, model_path: str, out: Path) -> dict:
    p = cfg.pipeline
    res = run_sft(model_path, Path(p.data_dir) / "sft.jsonl", out,
                  steps=p.sft_steps or None, time_budget_s=p.sft_time_s or None, lr=p.sft_lr,
                  batch_size=p.sft_batch_size, seed=cfg.run.seed, threads=p.threads,
                  warmup_frac=p.sft_warmup_frac, min_lr_frac=p.sft_min_lr_frac,
                  max_len=cfg.model.max_model_len, log=lambda s: print(s, flush=True),
                  tools=cfg.tools, template_kwargs=cfg.model.chat_template_kwargs,
                  chunk=p.sft_logprob_chunk_tokens, dtype=p.sft_dtype)
    return {k: v for k, v in res.items() if k != "history"}


def run_eval(cfg: Config, model_path: str, retriever_url: str, out: Path) -> dict:
    p = cfg.pipeline
    ecfg = cfg.model_copy(deep=True)
    ecfg.model.path = model_path
    ecfg.actors.threads = p.threads
    res = evaluate(ecfg, Path(p.data_dir) / "heldout.jsonl", k=p.eval_k,
                   limit=p.eval_limit or None, out_dir=out,
                   temperature=p.eval_temperature,
                   engine=p.eval_engine or None, retriever_url=retriever_url)
    return {"dir": str(out), **res}


def run_rl(cfg: Config, run_dir: Path, sft_path: str, retriever_url: str, quiet: bool) -> dict:
    """The RL stage: this job's config with the SFT model and the retriever, checked by the
    launcher (``checked``) and written once by it to RUN_DIR/config.yaml, the file every
    role reads. Nothing is resolved again: the model folder is the SFT stage's output, and
    its prompts' lengths and the custom tools were checked when the job started. A
    started stage continues from RUN_DIR/config.yaml."""
    started = (run_dir / "config.yaml").exists()
    args = LaunchRequest(resume=str(run_dir) if started else None, quiet=quiet)
    if started:
        _say(f"rl: continuing the RL run in {run_dir} from its newest checkpoint")
        if retriever_url:  # a new retriever process: its port changed
            args.overrides.append(f"tools.search.retriever_url={retriever_url}")
        rl_cfg = resolve(args)
    else:
        rl_cfg = cfg.model_copy(deep=True)
        rl_cfg.model.path = sft_path
        if retriever_url:
            rl_cfg.tools.search.retriever_url = retriever_url
        rl_cfg = with_ports(checked(rl_cfg))
    code = launch(rl_cfg, args)
    ckpt = latest_checkpoint(run_dir)
    if code != 0 or ckpt is None:
        raise RuntimeError(f"the RL stage failed (exit code {code}, newest checkpoint "
                           f"{ckpt}); see {run_dir}/logs and {run_dir}/events.jsonl")
    return {"checkpoint": str(ckpt), **rl_figures(run_dir)}


def rl_figures(run_dir: Path) -> dict:
    """Throughput, staleness and tool figures of the RL stage, from metrics.jsonl."""
    rows = read_metrics(run_dir)
    if not rows:
        return {"steps": 0}
    last, wall = rows[-1], rows[-1]["wall_time"]
    svc = last.get("service", {})
    hits = sum(v for k, v in svc.items() if k.endswith("tools/cache_hits"))
    misses = sum(v for k, v in svc.items() if k.endswith("tools/cache_misses"))
    return {
        "steps": last["step"], "rl_wall_s": round(wall, 1),
        "model_tokens_per_s": round(sum(r["model_tokens"] for r in rows) / max(wall, 1e-9), 1),
        "staleness_mean": round(sum(r["staleness_mean"] for r in rows) / len(rows), 3),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "dropped_stale": last["dropped_stale"],
        "tool_calls": sum(r.get("tool_calls", 0) for r in rows),
        "context_full": sum(r.get("rollout/context_full", 0) for r in rows),
        "prompts_skipped_too_long": sum(v for k, v in svc.items()
                                        if k.endswith("prompts_skipped_too_long")),
        # task.difficulty: prompts passed over as uninformative (actors/difficulty.py)
        "prompts_skipped_difficulty": sum(v for k, v in svc.items()
                                          if k.endswith("difficulty/skipped")),
        "tool_cache_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        **tenth_means(rows, "reward_mean", "reward"),
        **tenth_means(rows, "score_mean", "train_accuracy"),
        **branch_means(rows),
        # trained groups whose leaves' rewards differ (the rest have advantage 0)
        "nonzero_var": variance_summary(rows),
    }


def tenth_means(rows: list[dict], key: str, name: str) -> dict:
    """``<name>_first_tenth`` and ``<name>_last_tenth``: the mean of ``key`` over the
    first and the last tenth of the steps (at least one step each), so that one noisy
    step (8 groups) does not read as the stage's start or end."""
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return {f"{name}_first_tenth": None, f"{name}_last_tenth": None}
    n = max(1, len(values) // 10)
    return {f"{name}_first_tenth": round(sum(values[:n]) / n, 4),
            f"{name}_last_tenth": round(sum(values[-n:]) / n, 4)}


def branch_means(rows: list[dict]) -> dict:
    """The RL stage's branching figures: decisions, forks and fills in total, the fork
    rate (forks per decision), and the step means of the others (learner/rollout_metrics.py)."""
    decisions = sum(r.get("branch/decisions", 0) for r in rows)
    forks = sum(r.get("branch/forks", 0) for r in rows)
    out = {"branch_decisions": decisions, "branch_forks": forks,
           "branch_fills": sum(r.get("branch/fills", 0) for r in rows),
           "fork_rate": round(forks / decisions, 4) if decisions else 0.0,
           # share of all decisions with P outside [0.45, 0.55]: is the entropy signal acting?
           "p_outside_band_share": (round(sum(r.get("branch/p_outside_band", 0) for r in rows)
                                          / decisions, 4) if decisions else 0.0)}
    for key in ("branch/p_mean", "branch/p_std", "branch/dh_mean", "branch/leaves_per_group",
                "tools/executed_per_leaf"):
        vals = [r[key] for r in rows if key in r]
        out[key.replace("/", "_") + "_mean"] = round(sum(vals) / len(vals), 4) if vals else None
    out["branch_p_min"] = min((r["branch/p_min"] for r in rows if r.get("branch/decisions")),
                              default=None)
    out["branch_p_max"] = max((r["branch/p_max"] for r in rows if r.get("branch/decisions")),
                              default=None)
    return out


# ----------------------------------------------------------------------------- driver


def _user_config(args, cfg: Config | None) -> tuple[Config, Path]:
    if args.resume:
        run_dir = Path(args.resume)
        path = run_dir / USER_CONFIG
        if not path.is_file():
            raise ConfigError(f"--resume: {path} does not exist (not a pipeline run folder)")
        return load_config(path, args.overrides), run_dir
    cfg = cfg or load_config(args.config, args.overrides)
    run_dir = Path(cfg.run.dir)
    if (run_dir / STATE).exists() or (run_dir / "config.yaml").exists():
        raise ConfigError(f"run.dir: {run_dir} already holds a run; continue it with "
                          f"--resume {run_dir}, or choose another run.dir")
    return cfg, run_dir


def run(args, cfg: Config | None = None) -> int:
    """The whole job; returns the exit code (the summary is printed and saved). ``cfg``:
    ``args``' config already read (by the entry point), else it is read here."""
    cfg, run_dir = _user_config(args, cfg)
    # the launcher's checks of a run that cannot train or cannot bind safely, and the custom
    # tools: in seconds, before the data, SFT and the first evaluation, not at the RL stage
    checked(cfg)
    check_tools(cfg)
    quiet = bool(args.quiet)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / USER_CONFIG)
    stages = StageLog(run_dir)
    t0 = time.time() - stages.state.get("wall_time_s", 0.0)
    data = stages.run("data", build_data, cfg)
    model = stages.run("model", build_model, cfg)
    check_packing(cfg)  # a model the learner cannot pack stops now, not after SFT
    lengths = check_lengths(cfg)  # before SFT: a run that cannot fit stops now
    if lengths is not None:
        _say(f"lengths: {lengths.line()} (sampling.on_overflow={cfg.sampling.on_overflow})")
    sft_dir = run_dir / "sft"
    if cfg.pipeline.sft:
        stages.run("sft", cold_start_sft, cfg, model["path"], sft_dir)
        start_model = str(sft_dir)
    else:
        start_model = model["path"]
    with contextlib.ExitStack() as stack:
        url = cfg.tools.search.retriever_url
        if "search" in cfg.tools.enabled and not url:
            corpus = Path(data["dir"]) / "corpus.jsonl"
            url = stack.enter_context(RetrieverProcess(corpus, **suite_noise(corpus))).url
            _say(f"retriever over {data['dir']}/corpus.jsonl at {url}")
        before = stages.run("eval_sft", run_eval, cfg, start_model, url, run_dir / "eval" / "sft")
        rl = stages.run("rl", run_rl, cfg, run_dir, start_model, url, quiet)
        after = stages.run("eval_rl", run_eval, cfg, rl["checkpoint"], url, run_dir / "eval" / "rl")
    stages.state["wall_time_s"] = time.time() - t0
    name = "smollm2" if cfg.model.build == "smollm2" else Path(cfg.model.path).name
    summary = write_summary(run_dir, stages, before, rl, after, name)
    wandb_log_images(run_dir, cfg.metrics, [Path(p) for p in summary["plots"]])
    print_summary(summary)
    return 0


def gain_se(before_items: Path, after_items: Path) -> tuple[float, int]:
    """(standard error of pass@1 after RL minus after SFT, prompts paired): each held-out
    prompt's mean score over its k samples before and after, the difference per prompt,
    its sample sd over sqrt(n). Clustered by prompt: the k samples of a prompt are not
    independent, and the same prompts are evaluated twice (a paired design)."""
    def means(path: Path) -> dict[str, float]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {r["id"]: sum(r["scores"]) / len(r["scores"]) for r in rows if r["scores"]}

    a, b = means(before_items), means(after_items)
    diffs = [b[k] - a[k] for k in a.keys() & b.keys()]
    n = len(diffs)
    if n < 2:
        return float("nan"), n
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return (var / n) ** 0.5, n


GAIN_TARGET = 0.10  # pass@1 points RL should add over SFT, outside two standard errors


def write_summary(run_dir: Path, stages: StageLog, before: dict, rl: dict, after: dict,
                  model: str = "") -> dict:
    """RUN_DIR/summary.json: the RL run's own summary plus the pipeline's figures."""
    path = run_dir / "summary.json"
    rl_summary = json.loads(path.read_text()) if path.exists() else {}
    summary = {
        **rl_summary,
        "accuracy_after_sft": before["pass@1"], "accuracy_after_rl": after["pass@1"],
        "heldout_size": after["n"], "eval_k": after["k"],
        f"pass@{after['k']}_after_sft": before.get(f"pass@{after['k']}"),
        f"pass@{after['k']}_after_rl": after.get(f"pass@{after['k']}"),
        "tool_calls_per_sample": after["tool_calls_per_sample"],
        "tool_calls_per_sample_after_sft": before["tool_calls_per_sample"],
        # samples that answered without calling a tool (guesses on this suite)
        "no_tool_share_after_sft": before.get("no_tool_share"),
        "no_tool_share_after_rl": after.get("no_tool_share"),
        "per_kind": {k: {"after_sft": before["per_kind"][k]["pass@1"],
                         "after_rl": v["pass@1"]} for k, v in after["per_kind"].items()},
        "rl": {k: v for k, v in rl.items() if k != "seconds"},
        "stages_s": {k: v["seconds"] for k, v in stages.state["stages"].items()},
        "wall_time_s": round(stages.state["wall_time_s"], 1),
        "rl_status": rl_summary.get("status"),
        "model_name": model,
    }
    se, _ = gain_se(Path(before["dir"]) / "items.jsonl", Path(after["dir"]) / "items.jsonl")
    summary["gain_se"] = round(se, 4)
    summary["status"] = "ok"
    summary["plots"] = [str(p) for p in write_plots(run_dir)]
    atomic_write_bytes(path, json.dumps(summary, indent=1).encode())
    stages.save()
    return summary


def _nonzero_var_text(rl: dict) -> str:
    nz = rl.get("nonzero_var") or {}
    if nz.get("share") is None:
        return "not recorded"
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in nz.get("by_kind", {}).items())
    return (f"{nz['share']:.2f} of trained groups (first tenth {nz['first_tenth']:.2f}, "
            f"last {nz['last_tenth']:.2f}; by kind: {kinds})")


def print_summary(s: dict) -> None:
    rl = s["rl"]
    lines = [
        f"held-out accuracy (pass@1, {s['heldout_size']} prompts x {s['eval_k']} samples): "
        f"after SFT {s['accuracy_after_sft']:.3f} -> after RL {s['accuracy_after_rl']:.3f} "
        f"({100 * (s['accuracy_after_rl'] - s['accuracy_after_sft']):+.1f} points, "
        f"s.e. {100 * s.get('gain_se', float('nan')):.1f}, prompts paired)",
        "  by kind: " + ", ".join(f"{k} {v['after_sft']:.3f}->{v['after_rl']:.3f}"
                                  for k, v in s["per_kind"].items()),
        f"tool calls per answer: {s['tool_calls_per_sample_after_sft']:.2f} -> "
        f"{s['tool_calls_per_sample']:.2f}; answered without a tool: "
        f"{s['no_tool_share_after_sft']} -> {s['no_tool_share_after_rl']}",
        f"RL: {rl.get('steps')} learner steps in {rl.get('rl_wall_s')} s, "
        f"{rl.get('model_tokens_per_s')} model tokens/s, staleness mean "
        f"{rl.get('staleness_mean')} max {rl.get('staleness_max')}, tool cache hit rate "
        f"{rl.get('tool_cache_hit_rate')}",
        f"groups with reward variance (the rest teach nothing): {_nonzero_var_text(rl)}",
        "stages (s): " + ", ".join(f"{k} {v}" for k, v in s["stages_s"].items()),
        f"wall time: {s['wall_time_s']:.0f} s; plots: {', '.join(s['plots'])}",
    ]
    gain, se = s["accuracy_after_rl"] - s["accuracy_after_sft"], s.get("gain_se", float("nan"))
    met = gain >= GAIN_TARGET and gain - 2 * se > 0
    lines.append(f"RESULT {s.get('model_name') or 'job'} sft={s['accuracy_after_sft']:.3f} "
                 f"rl={s['accuracy_after_rl']:.3f} gain={gain:+.3f} se={se:.3f} "
                 f"target=gain>={GAIN_TARGET:.2f} {'met' if met else 'missed'}")
    print("\n".join(lines), flush=True)
