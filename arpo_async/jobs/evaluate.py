"""Evaluate a model on tool-use prompts through the real rollout: the training code path.

Every question runs through the tool-interleaved rollout (``actors/rollout``) under the
GRPO policy with ``group_size = K`` (K independent samples, tools executed through the
``ToolRunner``, scored by ``PromptSource.score``), on the vLLM or transformers engine, or
on a model served behind an OpenAI-compatible endpoint (``actors.engines.endpoint_engine``).

Reported: pass@1 (mean correctness over all samples), pass@k (mean over questions of the
best sample's correctness: the usual "any sample right" for 0/1 scores), the share of
well-formed responses, mean reward, tool calls per sample and per question, all also per
task kind (``kind`` of a synthetic row, else math/qa). Writes ``items.jsonl`` (question,
gold answers, the K decoded responses with tool results, scores, tool calls) and
``summary.json`` to the output folder.

Data: any file ``toolenv.tasks.data.load_examples`` reads, including the synthetic suite's
rl/heldout splits. Rows without a system prompt get the synthetic suite's one. With
``--corpus`` the BM25 retriever is started here (a child process) and stopped after.

CLI: ``python -m arpo_async.jobs.evaluate --model DIR --data FILE --k K [--limit N] [--out DIR]
[--engine vllm|transformers] [--temperature T] [--retriever URL | --corpus FILE]
[--endpoint URL] [--config YAML] [key=value ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from actors.engines import build_engine
from actors.engines.endpoint_engine import EndpointEngine
from arpo_async.core.config import Config, ConfigError, config_from_dict, load_config, set_value
from arpo_async.core.config.actors import engines_that
from arpo_async.core.files import atomic_write_json, write_jsonl
from arpo_async.jobs.synthetic import SYSTEM_PROMPT
from toolenv.retriever_server import RetrieverProcess
from toolenv.runner import build_tools
from toolenv.tasks.data import DataError
from toolenv.tasks.prompts import PromptSource
from toolenv.tasks.suite import suite_noise

PROGRESS_EVERY_S = 10.0


def eval_config(cfg: Config, data: str | Path, k: int, temperature: float | None = None,
                engine: str | None = None, retriever_url: str = "") -> Config:
    """``cfg`` set up for evaluation: GRPO rollout of K samples, the data file as the
    task, python (and search when a retriever is known) enabled."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tree = cfg.model_dump(mode="json")
    set_value(tree, "rollout.mode", "grpo")  # an AEPO run's own keys dropped
    tree["rollout"].update(group_size=k, initial_samples=k)
    tree["task"].update(name="file", data=str(data))
    if temperature is not None:
        tree["sampling"]["temperature"] = temperature
    if engine:  # another engine starts with its defaults; the run's own keeps its keys
        set_value(tree, "actors.engine", engine)
    tools = tree["tools"]
    if retriever_url:
        tools["search"]["retriever_url"] = retriever_url
    if not tools["enabled"] and not tools["custom"]:
        tools["enabled"] = (["python", "search"] if tools["search"]["retriever_url"]
                            else ["python"])
    return config_from_dict(tree)


def analysis_prompts(stack: contextlib.ExitStack, cfg: Config, data: Path, k: int,
                     corpus: Path | None, limit: int) -> tuple[Config, Any, PromptSource, list]:
    """What the analyses (jobs/analyze*.py) start from: ``cfg`` set up for evaluation
    with a local retriever over ``corpus`` (started in ``stack``, with the suite's noise),
    its tokenizer, the prompt source and its first ``limit`` prompts, encoded."""
    from transformers import AutoTokenizer  # heavy: not for --help

    url = (stack.enter_context(RetrieverProcess(corpus, **suite_noise(corpus))).url
           if corpus else "")
    cfg = eval_config(cfg, data, k, retriever_url=url)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    source = PromptSource(cfg, tok)
    prompts = source.items[:limit]
    for p in prompts:
        p.system_prompt = p.system_prompt or SYSTEM_PROMPT
        source.encode(p)
    return cfg, tok, source, prompts


def _row_kinds(path: Path) -> dict[str, str]:
    """Example id -> the row's own ``kind`` (synthetic splits carry arith/lookup/combo)."""
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return {}
    out = {}
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                row = json.loads(line)
                rid = row.get("id", row.get("idx", n - 1))
                if isinstance(row.get("kind"), str):
                    out[f"{path.stem}:{rid}"] = row["kind"]
    return out


def split_too_long(source: Any, prompts: list, data: Path,
                   refuse: bool = False) -> tuple[list, list[dict]]:
    """(prompts that fit, rows for those that do not): a prompt longer than the engine's
    room (``PromptSource.max_tokens``) is skipped and named, or with ``refuse`` stops the
    evaluation before the model loads, naming the file and row."""
    kept, skipped = [], []
    for p in prompts:
        if not source.too_long(p):
            kept.append(p)
            continue
        row = {"id": p.id, "row": p.meta.get("row"), "kind": p.kind, "question": p.question,
               "skipped": "too_long", "prompt_tokens": len(p.tokens)}
        if refuse:
            raise DataError(f"{data}: row {row['row']}: prompt of {len(p.tokens)} tokens > "
                            f"{source.max_tokens} (sampling.max_prompt_tokens="
                            f"{source.cfg.sampling.max_prompt_tokens}, model.max_model_len="
                            f"{source.cfg.model.max_model_len}); raise them, or drop "
                            "--refuse-too-long to skip and count such rows")
        skipped.append(row)
    return kept, skipped


def _summarise(items: list[dict], k: int) -> dict:
    def block(rows: list[dict]) -> dict:
        scores = np.array([r["scores"] for r in rows], dtype=float)
        rewards = np.array([r["rewards"] for r in rows], dtype=float)
        calls = np.array([r["tool_calls"] for r in rows], dtype=float)
        return {"n": len(rows), "pass@1": round(float(scores.mean()), 4),
                f"pass@{k}": round(float(scores.max(axis=1).mean()), 4),
                "format_ok": round(float((rewards > -1).mean()), 4),
                "reward_mean": round(float(rewards.mean()), 4),
                "tool_calls_per_sample": round(float(calls.mean()), 3),
                "no_tool_share": round(float((calls == 0).mean()), 4),
                "tool_calls_per_question": round(float(calls.sum(axis=1).mean()), 3)}

    out = block(items) if items else {"n": 0}
    kinds = sorted({r["kind"] for r in items})
    out["per_kind"] = {kind: block([r for r in items if r["kind"] == kind]) for kind in kinds}
    return out


async def _run_items(rollout: Any, source: Any, prompts: list, kinds: dict, tokenizer: Any,
                     concurrency: int, log: Callable[[str], None]) -> tuple[list[dict], int]:
    slots = asyncio.Semaphore(concurrency)
    items: list[dict | None] = [None] * len(prompts)
    done, tokens, t0, last = 0, 0, time.perf_counter(), [time.perf_counter()]

    async def one(i: int, prompt: Any) -> None:
        nonlocal done, tokens
        async with slots:
            try:
                group = await rollout.run(prompt if prompt.tokens else source.encode(prompt),
                                          actor_id=0)
            except Exception as exc:  # one request's engine or tool error: counted, go on
                items[i] = {"id": prompt.id, "row": prompt.meta.get("row"),
                            "question": prompt.question,
                            "error": f"{type(exc).__name__}: {exc}"[:300]}
                log(f"[eval] {prompt.id}: failed ({items[i]['error'][:120]}); going on")
                return
        leaves = group.leaves
        tokens += sum(int(leaf.loss_mask.sum()) for leaf in leaves)
        items[i] = {
            "id": prompt.id, "kind": kinds.get(prompt.id, prompt.kind),
            "question": prompt.question, "gold": prompt.answers,
            "responses": [tokenizer.decode(leaf.tokens.tolist(), skip_special_tokens=False)
                          for leaf in leaves],
            "scores": [float(leaf.score) for leaf in leaves],
            "rewards": [float(leaf.reward) for leaf in leaves],
            "tool_calls": [int(leaf.tool_calls) for leaf in leaves],
            "finish_reasons": [leaf.finish_reason for leaf in leaves],
        }
        done += 1
        now = time.perf_counter()
        if now - last[0] >= PROGRESS_EVERY_S or done == len(prompts):
            last[0] = now
            finished = [r for r in items if r is not None and "scores" in r]
            acc = np.mean([np.mean(r["scores"]) for r in finished]) if finished else 0.0
            log(f"[eval] {done}/{len(prompts)} questions  pass@1 so far {acc:.3f}  "
                f"{tokens / (now - t0):.0f} model tok/s  {now - t0:.0f} s")

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return [r for r in items if r is not None], tokens


async def _make_engine(cfg: Config, model_path: str, tokenizer: Any, endpoint: str) -> Any:
    if endpoint:
        return await EndpointEngine.create(endpoint, tokenizer)
    return await build_engine(cfg, model_path, actor_id=0, version=0)


def _prompts(source, data: Path, limit: int | None, system_prompt: str | None,
             refuse_too_long: bool) -> tuple[list, list]:
    """The prompts to evaluate (the first ``limit``, each with a system prompt), and the
    rows skipped as too long for the context."""
    prompts = source.items[:limit] if limit else source.items
    for p in prompts:
        p.system_prompt = p.system_prompt or system_prompt or SYSTEM_PROMPT
    return split_too_long(source, prompts, data, refuse_too_long)


def _speed(tokens: int, engine_s: float, gen_s: float, total_s: float) -> dict:
    return {"model_tokens": tokens, "engine_start_s": round(engine_s, 1),
            "generate_s": round(gen_s, 1), "total_s": round(total_s, 1),
            "model_tokens_per_s": round(tokens / max(gen_s, 1e-9), 1)}


async def evaluate_async(cfg: Config, data: str | Path, k: int = 4, limit: int | None = None,
                         out_dir: str | Path | None = None, temperature: float | None = None,
                         engine: str | None = None, retriever_url: str = "",
                         corpus: str | Path | None = None, endpoint: str = "",
                         concurrency: int = 64, system_prompt: str | None = None,
                         log: Callable[[str], None] | None = None,
                         refuse_too_long: bool = False) -> dict:
    """Evaluate ``cfg.model.path`` on ``data``; returns the summary (also written to
    ``out_dir``/summary.json with items.jsonl when ``out_dir`` is given)."""
    from transformers import AutoTokenizer  # transformers: heavy, not for --help

    from actors.rollout import GRPOPolicy, build_rollout

    t_start = time.perf_counter()
    log = log or functools.partial(print, flush=True)
    data = Path(data)
    model_path = cfg.model.path
    with contextlib.ExitStack() as stack:
        if corpus:
            retriever_url = stack.enter_context(RetrieverProcess(corpus, **suite_noise(corpus))).url
        cfg = eval_config(cfg, data, k, temperature, engine, retriever_url)
        work = Path(out_dir) if out_dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="arpo_eval_")))
        work.mkdir(parents=True, exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        source = PromptSource(cfg, tokenizer)
        prompts, skipped = _prompts(source, data, limit, system_prompt, refuse_too_long)
        tools = build_tools(cfg.tools, work)
        t0 = time.perf_counter()
        eng = await _make_engine(cfg, model_path, tokenizer, endpoint)
        engine_s = time.perf_counter() - t0
        try:
            rollout = build_rollout(cfg, eng, source, tokenizer, tools,
                                    np.random.default_rng([cfg.run.seed, 0xE7A1]), GRPOPolicy)
            t1 = time.perf_counter()
            items, tokens = await _run_items(rollout, source, prompts, _row_kinds(data),
                                             tokenizer, concurrency, log)
            gen_s = time.perf_counter() - t1
            tool_stats = tools.stats()
        finally:
            await eng.close()
            await tools.close()
    failed = [r for r in items if "error" in r]
    items = [r for r in items if "error" not in r]
    summary = {
        "model": str(model_path), "data": str(data), "k": k, "engine":
            "endpoint" if endpoint else cfg.actors.engine.type,
        "temperature": cfg.sampling.temperature, **_summarise(items, k),
        "skipped_too_long": len(skipped), "failed": len(failed),
        **_speed(tokens, engine_s, gen_s, time.perf_counter() - t_start), "tools": {
            key: tool_stats[key] for key in sorted(tool_stats)
            if key.endswith(("calls", "executed", "errors", "timeouts", "cache_hits"))},
    }
    if out_dir:
        write_jsonl(work / "items.jsonl", items + failed + skipped)
        atomic_write_json(work / "summary.json", summary)
    return summary


def evaluate(cfg: Config, data: str | Path, **kwargs: Any) -> dict:
    """Blocking wrapper of ``evaluate_async`` for the launcher (call it before and after
    RL with the SFT and the trained checkpoint as ``cfg.model.path``)."""
    return asyncio.run(evaluate_async(cfg, data, **kwargs))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Evaluate a tool-using model (pass@1, pass@k).")
    ap.add_argument("--model", required=True, help="model folder (also the tokenizer)")
    ap.add_argument("--data", required=True, help="JSONL/parquet prompts with answers")
    ap.add_argument("--k", type=int, default=4, help="samples per question")
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--out", default=None, help="folder for items.jsonl and summary.json")
    ap.add_argument("--engine", choices=engines_that("evaluates"), default=None,
                    help="generation engine (default: the config's actors.engine)")
    ap.add_argument("--temperature", type=float, default=None)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--retriever", default="", help="retriever URL (POST /retrieve)")
    src.add_argument("--corpus", default=None, help="JSONL corpus: start a local retriever")
    ap.add_argument("--endpoint", default="", help="OpenAI-compatible server base URL")
    ap.add_argument("--config", default=None, help="YAML config (default configs/default.yaml)")
    ap.add_argument("--concurrency", type=int, default=64, help="questions in flight")
    ap.add_argument("--refuse-too-long", action="store_true",
                    help="stop before loading the model when a prompt does not fit "
                    "model.max_model_len (default: skip such rows and count them)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.overrides, f"model.path={args.model}"])
        summary = evaluate(cfg, args.data, k=args.k, limit=args.limit, out_dir=args.out,
                           temperature=args.temperature, engine=args.engine,
                           retriever_url=args.retriever, corpus=args.corpus,
                           endpoint=args.endpoint, concurrency=args.concurrency,
                           refuse_too_long=args.refuse_too_long)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
