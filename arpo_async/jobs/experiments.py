"""Off-policy throughput experiments: what each actor count and staleness bound buys.

``python -m arpo_async.jobs.experiments sweep --actors 1,2,4 --max-staleness 0,1,2,4
[--simulate] [--steps 10] [--time-limit 300] [--out DIR] [--config F] [key=value ...]``
runs one short real run (``arpo_async.launch``) per grid point, one after another, each
bounded by ``--steps`` learner steps and ``--time-limit`` seconds, then writes
``DIR/sweep.csv`` (one row per run, columns ``COLUMNS``), ``DIR/sweep.json`` (rows plus
per-run series) and four plots in ``DIR/plots/``: throughput vs actors, learner
utilisation vs actors, staleness histogram, reward vs wall-clock per setting.
``--max-staleness 0`` is the synchronous baseline: admission control then lets actors
start a batch only once the learner has published the weights of the previous step
(lockstep generation, docs/design.md "Staleness and admission"). ``--simulate`` uses the
simulated engine (``actors.engine=simulated``; all actors of a run in one process unless
``actors.engine.actors_per_process`` is given), so large actor counts fit on one machine.

``python -m arpo_async.jobs.experiments chaos ...`` is the chaos soak: a real
run under seeded random faults, then a verdict (arpo_async/jobs/chaos.py).

What the columns mean (``summarize_run``; the first learner step includes start-up, so
rates use the steady window from the end of step 1 to the end of the last step):
trajectories_per_s, groups_per_s, model_tokens_per_s: trained leaves, groups and model
tokens of steps 2..N over that window; learner_busy_frac: sum of (step_time_s - wait_s)
over the window, learner_wait_frac: sum of wait_s over it; actor_idle_frac: slot time
spent waiting for a ticket (admission), actor_blocked_frac: slot time blocked sending
(backpressure), both sum(idle) / sum(elapsed * slots) over actors from their last stats,
where slots is 1 (the admission loop) with trajectory-level scheduling and
actors.concurrent_groups with group slots (``admission_slots``); generating_frac: the
actors' time-averaged trajectories generating over their
actors.max_inflight_trajectories; staleness_mean/max over trained groups; dropped_stale
and dropped_other (groups dropped for a reason other than staleness, stopping excluded) and
dropped_at_stop (in flight when the run ended); reward_last and accuracy_last: mean of
the last three steps; ledger_ok: every actor's sent == received == trained + dropped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from arpo_async.core.config import SPINE_CONFIG, ConfigError, load_config
from arpo_async.core.metrics import read_metrics
from arpo_async.jobs import chaos
from arpo_async.jobs.tiny_model import ensure_model

REPO = Path(__file__).resolve().parents[2]
COLUMNS = [
    "name", "mode", "actors", "max_staleness", "engine", "status", "steps", "wall_time_s",
    "window_s", "trajectories_per_s", "groups_per_s", "model_tokens_per_s", "learner_busy_frac",
    "learner_wait_frac", "actor_idle_frac", "actor_blocked_frac", "generating_frac",
    "staleness_mean", "staleness_max", "dropped_stale", "dropped_other", "dropped_at_stop",
    "reward_first", "reward_last", "accuracy_last", "ledger_ok",
]
_GRID_KEYS = ("actors.num", "learner.max_staleness")


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise SystemExit(f"{flag}: {text!r} needs distinct integers >= 0")
    return values


# ----------------------------------------------------------------------------- one run
def _mean(values) -> float:
    values = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else float("nan")


def _ledger_ok(ledger: dict) -> bool:
    if not ledger:
        return False
    return all(led["sent"] >= 0 and led["received"] == led["sent"]
               and led["trained"] + sum(led["dropped"].values()) == led["sent"]
               for led in ledger.values())


def _actor_fractions(service: dict, slots: int) -> tuple[float, float]:
    idle = blocked = slot_s = 0.0
    for key, value in service.items():
        if key.startswith("actor") and key.endswith("/elapsed_s"):
            prefix = key[: -len("elapsed_s")]
            slot_s += float(value) * slots
            idle += float(service.get(prefix + "idle_s", 0.0))
            blocked += float(service.get(prefix + "send_blocked_s", 0.0))
    if slot_s <= 0:
        return float("nan"), float("nan")
    return idle / slot_s, blocked / slot_s


def admission_slots(cfg) -> int:
    """The loops that ask for tickets in one actor: one scheduler, or the group slots."""
    return 1 if cfg.actors.max_inflight_trajectories > 0 else cfg.actors.concurrent_groups


def _generating_frac(service: dict) -> float:
    shares = [float(v) / float(service[k[: -len("_mean")] + "_target"])
              for k, v in service.items()
              if k.startswith("actor") and k.endswith("/generating_mean")
              and float(service.get(k[: -len("_mean")] + "_target", 0) or 0) > 0]
    return sum(shares) / len(shares) if shares else float("nan")


def summarize_run(run_dir: str | Path, slots: int) -> tuple[dict, dict]:
    """(row, series) of one finished run folder; see the module docstring for the
    definitions. ``slots`` is ``admission_slots(cfg)``. Missing files give NaNs and
    ``ledger_ok`` False, never an exception."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    summary = _read_json(run_dir / "summary.json")
    learner = _read_json(run_dir / "learner_summary.json")
    row: dict = {"steps": rows[-1]["step"] if rows else 0,
                 "wall_time_s": summary.get("wall_time_s", float("nan")),
                 "ledger_ok": _ledger_ok(summary.get("ledger") or learner.get("ledger", {}))}
    series: dict = {"wall_time": [r["wall_time"] for r in rows],
                    "reward": [r["reward_mean"] for r in rows], "lag_hist": {}}
    if not rows:
        return row, series
    steady = rows[1:]
    window = rows[-1]["wall_time"] - rows[0]["wall_time"]
    if not steady or window <= 0:  # one step: fall back to the whole run, start-up included
        steady, window = rows, rows[-1]["wall_time"]
    row["window_s"] = window
    row["trajectories_per_s"] = sum(r["leaves"] for r in steady) / window
    row["groups_per_s"] = sum(r["groups"] for r in steady) / window
    row["model_tokens_per_s"] = sum(r["model_tokens"] for r in steady) / window
    row["learner_busy_frac"] = sum(r["step_time_s"] - r["wait_s"] for r in steady) / window
    row["learner_wait_frac"] = sum(r["wait_s"] for r in steady) / window
    groups = sum(r["groups"] for r in rows)
    row["staleness_mean"] = sum(r["staleness_mean"] * r["groups"] for r in rows) / groups
    row["staleness_max"] = max(r["staleness_max"] for r in rows)
    service = learner.get("service") or rows[-1].get("service", {})
    row["actor_idle_frac"], row["actor_blocked_frac"] = _actor_fractions(service, slots)
    row["generating_frac"] = _generating_frac(service)
    dropped = dict(service.get("dropped", {}))
    row["dropped_at_stop"] = dropped.pop("shutdown", 0)
    row["dropped_stale"] = dropped.pop("stale", 0)
    row["dropped_other"] = sum(dropped.values())
    row["reward_first"] = rows[0]["reward_mean"]
    row["reward_last"] = _mean(r["reward_mean"] for r in rows[-3:])
    row["accuracy_last"] = _mean(r["score_mean"] for r in rows[-3:])
    series["lag_hist"] = {int(k): int(v) for k, v in
                          service.get("staleness", {}).get("lag_hist", {}).items()}
    return row, series


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def launch_run(argv: list[str], log_path: Path, timeout_s: float) -> str:
    """Run ``arpo_async.launch`` to the end; returns "ok", "failed (rc N)" or "timeout".
    On timeout the launcher gets SIGINT, which stops its roles cleanly."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "arpo_async.launch", "--quiet", *argv],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return "timeout"
    return "ok" if rc == 0 else f"failed (rc {rc})"


# ----------------------------------------------------------------------------- the sweep
def _check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in _GRID_KEYS:
            raise SystemExit(f"{key}: set by the grid (--actors / --max-staleness), not key=value")


def plan_runs(args) -> tuple[list[tuple[str, list[str], object]], str]:
    """Validated (name, launch argv, config) per grid point, and the model folder (built
    once here when it is missing, so runs do not race to build it)."""
    _check_overrides(args.overrides)
    base = list(args.overrides)
    if args.simulate:
        base = ["actors.engine=simulated", *base]
    try:
        cfg = load_config(args.config, base)
        model = str(ensure_model(cfg.model.path, cfg.model).resolve())
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"config error: {exc}") from None
    user_keys = {o.split("=", 1)[0].strip() for o in args.overrides}
    out = Path(args.out).resolve()
    runs = []
    for n in args.actors:
        for eta in args.max_staleness:
            name = f"a{n}_s{eta}"
            extra = [f"model.path={model}", f"run.dir={out / 'runs' / name}",
                     f"learner.max_steps={args.steps}", f"run.time_limit_s={args.time_limit}",
                     f"actors.num={n}", f"learner.max_staleness={eta}"]
            if args.simulate and "actors.engine.actors_per_process" not in user_keys:
                extra.append(f"actors.engine.actors_per_process={max(n, 1)}")
            overrides = [*base, *extra]
            try:
                run_cfg = load_config(args.config, overrides)
            except ConfigError as exc:
                raise SystemExit(f"config error in {name}: {exc}") from None
            argv = ([f"--config={args.config}"] if args.config else []) + overrides
            runs.append((name, argv, run_cfg))
    return runs, model


def sweep(args) -> list[dict]:
    runs, model = plan_runs(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"sweep: {len(runs)} runs, model {model}, results in {out}", flush=True)
    rows, series = [], {}
    for name, argv, cfg in runs:
        t0 = time.time()
        status = launch_run(argv, out / "logs" / f"{name}.log",
                            timeout_s=args.time_limit + args.startup_timeout)
        row, ser = summarize_run(cfg.run.dir, admission_slots(cfg))
        row |= {"name": name, "actors": cfg.actors.num, "max_staleness":
                cfg.learner.max_staleness, "engine": cfg.actors.engine.type, "status": status,
                "mode": "sync (lockstep)" if cfg.learner.max_staleness == 0 else "async"}
        rows.append({c: row.get(c, float("nan")) for c in COLUMNS})
        series[name] = ser
        print(f"  {name}: {status} in {time.time() - t0:.0f} s, steps {row['steps']}, "
              f"{row.get('trajectories_per_s', float('nan')):.2f} traj/s, learner busy "
              f"{row.get('learner_busy_frac', float('nan')):.2f}", flush=True)
    write_csv(rows, out / "sweep.csv")
    (out / "sweep.json").write_text(json.dumps({"rows": rows, "series": series}, indent=1))
    for path in plot_sweep(rows, series, out / "plots"):
        print(f"  plot {path}")
    print(f"wrote {out / 'sweep.csv'}")
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v
                             for k, v in row.items()})


# ----------------------------------------------------------------------------- plots
def _by_eta(rows: list[dict], key: str) -> dict[int, tuple[list, list]]:
    lines: dict[int, tuple[list, list]] = {}
    for r in sorted(rows, key=lambda r: (r["max_staleness"], r["actors"])):
        xs, ys = lines.setdefault(r["max_staleness"], ([], []))
        xs.append(r["actors"])
        ys.append(r[key])
    return lines


def _label(eta: int) -> str:
    return "eta=0 (sync)" if eta == 0 else f"eta={eta}"


def plot_sweep(rows: list[dict], series: dict, out_dir: Path) -> list[Path]:
    """The four PNGs; returns their paths."""
    import matplotlib  # matplotlib: heavy; its backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, ylabel, fname in (
            ("trajectories_per_s", "trained trajectories / s", "throughput_vs_actors.png"),
            ("learner_busy_frac", "learner busy fraction", "learner_util_vs_actors.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for eta, (xs, ys) in _by_eta(rows, key).items():
            ax.plot(xs, ys, marker="o", label=_label(eta))
        ax.set_xlabel("actors")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        counts = sorted({r["actors"] for r in rows})
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out_dir / fname))
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["name"] for r in rows]
    lags = sorted({lag for n in names for lag in series[n]["lag_hist"]}) or [0]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        hist = series[name]["lag_hist"]
        total = max(sum(hist.values()), 1)
        ax.bar([lag + (i - len(names) / 2 + 0.5) * width for lag in lags],
               [hist.get(lag, 0) / total for lag in lags], width, label=name)
    ax.set_xticks(lags)
    ax.set_xlabel("staleness (versions behind when trained)")
    ax.set_ylabel("fraction of groups")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out_dir / "staleness_hist.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ax.plot(series[name]["wall_time"], series[name]["reward"], marker=".", label=name)
    ax.set_xlabel("wall-clock since learner start (s)")
    ax.set_ylabel("mean reward of the step's batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out_dir / "reward_vs_wallclock.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arpo_async.jobs.experiments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="run the actors x max-staleness grid")
    s.add_argument("--actors", default="1,2,4", help="actor counts, e.g. 1,2,4")
    s.add_argument("--max-staleness", default="0,1,2,4", help="eta values; 0 = synchronous")
    s.add_argument("--simulate", action="store_true",
                   help="simulated engine (actors.engine=simulated; its keys: actors.engine.*)")
    s.add_argument("--steps", type=int, default=10, help="learner steps per run")
    s.add_argument("--time-limit", type=float, default=300.0, help="seconds per run after start")
    s.add_argument("--startup-timeout", type=float, default=600.0,
                   help="extra seconds a run may take to start before it is stopped")
    s.add_argument("--out", default="runs/sweep", help="output folder")
    s.add_argument("--config", default=None,
                   help="base YAML config (default: configs/spine.yaml, the RL stage alone)")
    s.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides for every run")
    chaos.add_arguments(sub.add_parser(
        "chaos", help="a real run under seeded random faults, then a verdict",
        description=chaos.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    args = p.parse_args(argv)
    if args.cmd == "chaos":
        return chaos.run(args)
    args.config = args.config or str(SPINE_CONFIG)
    args.actors = parse_ints(args.actors, "--actors")
    args.max_staleness = parse_ints(args.max_staleness, "--max-staleness")
    if 0 in args.actors:
        raise SystemExit("--actors: every run needs at least one actor")
    if args.steps < 2:
        raise SystemExit("--steps: at least 2 (rates are measured after the first step)")
    rows = sweep(args)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
