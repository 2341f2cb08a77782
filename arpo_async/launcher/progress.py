"""Live progress for the launcher: a rich panel (or, in quiet mode, a plain line every few
seconds) built from the tail of ``metrics.jsonl``."""

from __future__ import annotations

import sys
import time

from rich.live import Live
from rich.table import Table

from arpo_async.core.metrics import read_metrics


class Progress:
    def __init__(self, cfg, quiet: bool = False, every_s: float = 5.0):
        """``quiet`` (the launcher's --quiet): plain lines, as when stdout is no terminal."""
        self.cfg = cfg
        self.t0 = time.time()
        self.every_s = every_s
        self.last_print = 0.0
        self.notes: list[str] = []
        self.live = None
        if not quiet and sys.stdout.isatty():
            self.live = Live(self._render(None), refresh_per_second=2, transient=False)
            self.live.start()

    def note(self, text: str) -> None:
        self.notes = (self.notes + [text])[-3:]
        if self.live is None:
            print(f"[launch] {text}", flush=True)

    def _fields(self, row: dict | None) -> dict[str, str]:
        total = self.cfg.learner.max_steps
        elapsed = time.time() - self.t0
        if not row:
            return {"step": f"0/{total}", "elapsed": f"{elapsed:.0f}s", "status": "starting"}
        step = row["step"]
        eta = (row["wall_time"] / step) * (total - step) if step else float("nan")
        if self.cfg.run.time_limit_s > 0:  # the time limit may end the run first
            eta = min(eta, max(self.cfg.run.time_limit_s - row["wall_time"], 0.0))
        svc = row.get("service", {})
        actor_tps = [v for k, v in svc.items() if k.endswith("/tokens_per_s")]
        tool_hits = [v for k, v in svc.items() if k.endswith("tools/cache_hits")]
        tool_miss = [v for k, v in svc.items() if k.endswith("tools/cache_misses")]
        lookups = sum(tool_hits) + sum(tool_miss)
        return {
            "step": f"{step}/{total}", "version": str(row["policy_version"]),
            "reward": f"{row['reward_mean']:+.3f}", "accuracy": f"{row.get('score_mean', 0):.3f}",
            "tokens/s per actor": " ".join(f"{v:.0f}" for v in actor_tps) or "-",
            "staleness max": str(row["staleness_max"]), "dropped stale": str(row["dropped_stale"]),
            "token yield": _token_yield(svc.get("tokens")),
            "prefill per token": _prefill(svc.get("tokens")),
            "actors alive": str(row["actors_alive"]), "learner wait": f"{row['wait_s']:.2f}s",
            "fork rate": _fork_rate(row),
            "tool calls": str(row.get("tool_calls", 0)),
            "tool cache hit": f"{sum(tool_hits) / lookups:.0%}" if lookups else "-",
            "elapsed": f"{elapsed:.0f}s", "ETA": f"{eta:.0f}s",
        }

    def _render(self, row: dict | None):
        table = Table(title="arpo_async", show_header=False, expand=False)
        for k, v in self._fields(row).items():
            table.add_row(k, v)
        for n in self.notes:
            table.add_row("note", n)
        return table

    def update(self) -> None:
        rows = read_metrics(self.cfg.run.dir)
        row = rows[-1] if rows else None
        if self.live is not None:
            self.live.update(self._render(row))
        elif time.time() - self.last_print >= self.every_s:
            self.last_print = time.time()
            print("[launch] " + "  ".join(f"{k}={v}" for k, v in self._fields(row).items()),
                  flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def final(self, summary: dict) -> None:
        keys = ("status", "steps", "policy_version", "wall_time_s", "step_time_s_mean",
                "broadcast_time_s_mean", "reward_mean_last")
        print("summary: " + ", ".join(f"{k}={summary.get(k)}" for k in keys), flush=True)
        total = summary.get("prompts")
        if total:  # learner/ledger.py PromptRecord
            print(f"prompts: {total['taken']} taken (trained or dropped with a reason), "
                  f"{total['duplicates']} duplicates dropped, {total['skipped']} skipped",
                  flush=True)
        for gone in summary.get("actors_not_back", []):
            print(f"actor {gone['actor']} ({gone['host'] or 'host unknown'}) never came back: "
                  f"silent {gone['silent_s']:.0f} s at the end, {gone['received']} of its "
                  f"groups received", flush=True)
        print(f"run folder: {self.cfg.run.dir}", flush=True)


def _fork_rate(row: dict) -> str:
    """Forks per branch decision in this step, with the decisions' mean probability."""
    decisions = row.get("branch/decisions", 0)
    if not decisions:
        return "-"
    return f"{row.get('branch/forks', 0) / decisions:.2f} (P {row.get('branch/p_mean', 0):.2f})"


def _token_yield(tokens) -> str:
    """Model tokens trained / received, and the KS distance of trained vs received group
    lengths over the last steps (learner/tokens.py)."""
    if not isinstance(tokens, dict) or not tokens.get("received"):
        return "-"
    ks = next((v for k, v in tokens.items() if k.startswith("ks_last")), 0.0)
    return f"{tokens['yield']:.3f} (KS {ks:.2f})"


def _prefill(tokens) -> str:
    """Prompt tokens the engines computed per token sampled, and of them the context
    prefilled again after interrupting weight updates (learner/tokens.py prefill_figures)."""
    pre = tokens.get("prefill") if isinstance(tokens, dict) else None
    if not pre:
        return "-"
    return f"{pre['prefill_per_sampled']:.1f} ({pre['recomputed_per_sampled']:.2f} again)"

