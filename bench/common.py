"""Shared pieces of the benchmarks in bench/: results files, a model that calls tools,
a sleep tool, a learner-side sink process, and the actor-path / raw-vLLM harness.

The tool-calling model: a random tiny model almost never writes ``<python>``, so a
benchmark of the tool path would measure nothing. ``build_tool_caller`` takes the
locally built Qwen3 model and rewrites two tensors so that, whatever the context, its
next-token distribution is a fixed unigram law with chosen probabilities for the tags
(embedding column 0 set to a large constant, so the final hidden state points along that
axis; ``lm_head`` column 0 set to the desired logits, the other columns zeroed). It is
still the full network, run by the real vLLM engine at full cost; only what it says is
chosen: about one round in two ends in ``<python>...</python>``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from arpo_async.core.ports import free_port  # noqa: F401  (the benches import it from here)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SCRATCH_DIR = "/tmp/arpo_bench"  # models built for the benchmarks, run folders


def host_info() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "loadavg_1m": load[0], "python": sys.version.split()[0],
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_results(name: str, data: dict, out: str | Path | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host_info(), **data}, indent=2, default=float) + "\n")
    print(f"wrote {path}")
    return path


def tree_cpu_s(exclude: tuple[int, ...] = ()) -> float:
    """CPU seconds (user + system) of this process and its descendants (vLLM's engine
    core and worker), minus the ``exclude`` pids: a cost that other jobs on a shared
    machine do not inflate the way they inflate wall time."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        if proc.pid in exclude:
            continue
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


def ensure_tiny(path: str | Path, hidden: int = 128, layers: int = 2) -> Path:
    from arpo_async.jobs.tiny_model import build_tiny_model

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    return build_tiny_model(path, hidden=hidden, layers=layers, heads=max(4, hidden // 64))


# ----------------------------------------------------------------------------- tool caller
TOOL_CALLER_PROBS = {"<python>": 0.08, "</python>": 0.03, "<|im_end|>": 0.004,
                     "</answer>": 0.004, "<answer>": 0.004}
_SILENT = ("<search>", "</search>", "<result>", "</result>", "<|endoftext|>", "<|im_start|>")


def build_tool_caller(path: str | Path, probs: dict[str, float] | None = None) -> Path:
    """The tiny model with a fixed next-token law (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    probs = probs or TOOL_CALLER_PROBS
    base = ensure_tiny(path.with_name(path.name + "-base"))
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids = {t: tok.convert_tokens_to_ids(t) for t in [*probs, *_SILENT]}
    vocab = model.lm_head.weight.shape[0]
    rest = vocab - len(ids)
    logits = torch.full((vocab,), math.log((1 - sum(probs.values())) / rest))
    for t, i in ids.items():
        logits[i] = math.log(probs[t]) if t in probs else -30.0
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # dominates the residual stream
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = logits / math.sqrt(hidden)  # normed[0] ~ sqrt(hidden)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


class SleepTool:
    """A tool answering after ``delay_s`` (asyncio.sleep): the latency of a remote tool
    without its CPU cost. Registered under an existing tool name so the tags match."""

    version = "sleep-1"

    def __init__(self, name: str, delay_s: float):
        self.name, self.delay_s = name, delay_s

    async def call(self, args: str):
        from toolenv.base import ToolResult

        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return ToolResult(f"{len(args)}", ok=True)

    async def close(self) -> None:
        return None


# ----------------------------------------------------------------------------- the sink
def sink_main(cfg_json: str, conn) -> None:
    """A learner-side endpoint without training (multiprocessing target): real
    LearnerService (tickets, receiver, ledger); every group is counted as trained."""
    from arpo_async.core.config import config_from_dict
    from learner.service import LearnerService

    service = LearnerService(config_from_dict(json.loads(cfg_json)))
    conn.send("ready")
    received = 0
    while not conn.poll():
        groups = service.collect(1, timeout_s=3600, should_stop=conn.poll)
        if groups:
            service.mark_trained(groups)
            received += len(groups)
    conn.recv()
    conn.send({"received": received, "ledger": service.shutdown(wait_s=5)})


class Sink:
    def __init__(self, cfg):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sink_main, args=(cfg.model_dump_json(), child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("sink process did not start")

    def close(self) -> dict:
        self.conn.send("stop")
        out = self.conn.recv() if self.conn.poll(60) else {}
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return out


def sink_config(cfg) -> object:
    """``cfg`` with fresh ports, one actor, and admission that never throttles (the sink
    does not publish weights, so actors stay at version 0)."""
    cfg = cfg.model_copy(deep=True)
    cfg.transport.trajectory_port = free_port()
    cfg.transport.control_port = free_port()
    cfg.learner.max_staleness = 10**6
    cfg.learner.batch_groups = 1
    cfg.actors.num = 1  # the learner waits for this many actors before granting tickets
    return cfg


# ----------------------------------------------------------------------------- harness
class CountingEngine:
    """Delegates to an engine and counts the tokens its generate calls return."""

    def __init__(self, inner):
        self.inner, self.tokens, self.calls = inner, 0, 0
        self.inflight, self._area, self._last = 0, 0.0, time.perf_counter()
        self.prompt_tokens = 0  # context re-sent with each call (prefilled unless cached)

    @property
    def version(self) -> int:
        return self.inner.version

    def area(self) -> float:
        """Integral of calls in flight over time (seconds x calls)."""
        now = time.perf_counter()
        self._area += self.inflight * (now - self._last)
        self._last = now
        return self._area

    async def generate(self, req):
        self.area()
        self.inflight += 1
        try:
            res = await self.inner.generate(req)
        finally:
            self.area()
            self.inflight -= 1
        self.tokens += len(res.tokens)
        self.prompt_tokens += len(req.prompt_tokens)
        self.calls += 1
        return res

    async def update_weights(self, tensors, version):
        return await self.inner.update_weights(tensors, version)

    async def sequence_logprobs(self, prompt_tokens, tokens):
        return await self.inner.sequence_logprobs(prompt_tokens, tokens)

    async def close(self) -> None:
        return None


async def actor_window(cfg, engine, tokenizer, tools, warmup_s: float, window_s: float,
                       profiler=None) -> dict:
    """The real Actor (tickets, AgentRollout, tools, sends to a sink process) on
    ``engine``; model tokens/s and CPU seconds over ``window_s`` after ``warmup_s``
    (``profiler``, a cProfile.Profile, runs during the window when given)."""
    import numpy as np

    from actors.actor import Actor
    from actors.rollout import build_rollout
    from arpo_async.core.transport.control import ControlClient
    from arpo_async.core.transport.trajectory import TrajectorySender
    from toolenv.tasks.prompts import PromptSource

    cfg = sink_config(cfg)
    sink = Sink(cfg)
    t = cfg.transport
    sender = TrajectorySender(f"tcp://{t.host}:{t.trajectory_port}", hwm=t.send_hwm)
    control = ControlClient(f"tcp://{t.host}:{t.control_port}")
    counting = CountingEngine(engine)
    source = PromptSource(cfg, tokenizer, stream=0)
    rollout = build_rollout(cfg, counting, source, tokenizer, tools,
                            np.random.default_rng([cfg.run.seed, 1000]))
    actor = Actor(cfg, 0, counting, rollout, source, sender, control, len(tokenizer), tools)
    task = asyncio.create_task(actor.run())
    skip = (sink.proc.pid,)
    try:
        await asyncio.sleep(warmup_s)
        t0, n0, g0, c0 = time.perf_counter(), counting.tokens, actor.groups_sent, tree_cpu_s(skip)
        a0, r0, p0 = counting.area(), counting.calls, counting.prompt_tokens
        o0 = rollout.occupancy.area()
        if profiler is not None:
            profiler.enable()
        await asyncio.sleep(window_s)
        if profiler is not None:
            profiler.disable()
        t1, n1, g1, c1 = time.perf_counter(), counting.tokens, actor.groups_sent, tree_cpu_s(skip)
        a1, r1, p1 = counting.area(), counting.calls, counting.prompt_tokens
        o1 = rollout.occupancy.area()
        actor.stop = True
        await task
    finally:
        task.cancel()
        sender.close()
        control.close()
        ledger = sink.close()
    if n1 == n0:
        raise RuntimeError(f"the actor generated nothing in {window_s} s (sink: {ledger})")
    return {"tokens": n1 - n0, "seconds": t1 - t0, "tokens_per_s": (n1 - n0) / (t1 - t0),
            "cpu_s": c1 - c0, "tokens_per_cpu_s": (n1 - n0) / max(c1 - c0, 1e-9),
            "groups": g1 - g0, "rounds": r1 - r0, "mean_in_flight": (a1 - a0) / (t1 - t0),
            "prompt_tokens_per_round": (p1 - p0) / max(r1 - r0, 1), "idle_s": actor.idle_s,
            # trajectories generating (Occupancy: not finished, not waiting for a tool)
            "generating_mean": (o1 - o0) / (t1 - t0),
            "engine": engine.stats() if hasattr(engine, "stats") else {},
            "tool_calls": actor.tool_calls, "sink": ledger}


async def raw_vllm(engine, prompts: list[list[int]], concurrency: int, target_tokens: int,
                   sampling: dict, window: int = 0) -> dict:
    """vLLM's AsyncLLM.generate called directly (no rollout, no actor), ``concurrency``
    requests in flight, until ``target_tokens`` tokens came back. ``window`` > 0: each
    round as the actor sends it (``GenRequest.topk_window``): the first ``window`` tokens
    with ``sampling["logprobs"]`` top log-probs, then, if the round goes on, a second
    request from prompt + those tokens with the sampled token's log-prob only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine._llm  # the bench measures vLLM itself, under the engine wrapper
    count, rounds = 0, []

    async def loop(i: int) -> None:
        nonlocal count
        j = 0
        while count < target_tokens:
            prompt = prompts[(i + j * concurrency) % len(prompts)]
            parts = ([dict(sampling, max_tokens=min(window, sampling["max_tokens"])),
                      dict(sampling, logprobs=0)] if window else [sampling])
            got = []
            for part in parts:
                part = dict(part, max_tokens=part["max_tokens"] - len(got))
                params = SamplingParams(n=1, seed=i * 100003 + j, detokenize=False, **part)
                final = None
                async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt + got),
                                              params, f"raw-{i}-{j}-{time.monotonic_ns()}"):
                    final = out
                comp = final.outputs[0]
                got += list(comp.token_ids)
                count += len(comp.token_ids)
                if comp.finish_reason != "length" or len(got) >= sampling["max_tokens"]:
                    break
            rounds.append(len(prompt))
            j += 1

    t0, c0 = time.perf_counter(), tree_cpu_s()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    seconds, cpu = time.perf_counter() - t0, tree_cpu_s() - c0
    return {"tokens": count, "seconds": seconds, "tokens_per_s": count / seconds,
            "cpu_s": cpu, "tokens_per_cpu_s": count / max(cpu, 1e-9), "rounds": len(rounds),
            "prompt_tokens_per_round": sum(rounds) / max(len(rounds), 1)}
