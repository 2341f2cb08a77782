"""Cold-start supervised fine-tuning on tool-use traces, token in, token out.

Each trace is tokenised the way the actor will see it: the chat-templated prompt (with the
generation prompt), then every response segment encoded on its own and concatenated -- a
model segment is what the model samples in its rounds; a tool segment is
``syntax.result_ids(output)`` (``format_result`` of the output with the tokenizer's control
tokens defused: toolenv.tags.defuse), exactly what ``PathStepper.tool`` appends after a round
that ended at a closing tool tag -- and the EOS
token after ``</answer>``. The loss covers model tokens and that EOS only: prompt and
tool-result tokens are inputs, never targets. With ``tools.syntax=hermes`` (``run_sft(...,
tools=cfg.tools)``) the traces' ARPO calls become JSON calls and their results the chat
template's tool message (``toolenv/syntax.py``), again as the rollout writes them.

The mask boundary is exact with any tokenizer: because each segment is encoded alone, no
token crosses a segment boundary, so the mask changes exactly where the segments do. With
a tokenizer whose tags are several tokens (``tiny_model --tags-as-text``, Qwen's), a tag
that merges with its neighbours (``)</``, ``>print``) does so inside its own segment and
takes that segment's mask; ``</python>`` + ``\n<result>`` never becomes one ``>\n``
token spanning the call and the result (docs/design.md "Tags as text").

Plain torch AdamW on CPU with linear warm-up then cosine decay to 10 % of the peak rate,
over the step budget (or over the time budget when only that is given). The checkpoint
(model + tokenizer) is written to ``OUT.tmp``, fsynced and renamed into place, so ``OUT``
is either the old checkpoint or the complete new one.

CLI: ``python -m arpo_async.jobs.sft --model DIR --data sft.jsonl --out DIR [--steps N |
--time-budget-s S] [--lr 2e-3 --batch-size 16 --seed 0 --threads 2]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from arpo_async.core.config import ToolsConfig
from arpo_async.core.files import iter_jsonl
from toolenv.syntax import ArpoSyntax, build_syntax
from toolenv.tags import find_tool_call, unwrap_result
from toolenv.tasks.prompts import encode_prompt

LOG_EVERY_S = 10.0


class SFTDataError(ValueError):
    """A trace that cannot be trained on; the message names the file and row."""


# ----------------------------------------------------------------------------- data


def prompt_ids(tokenizer: Any, system: str | None, question: str,
               syntax: Any = None) -> list[int]:
    """The chat-templated prompt, as ``PromptSource.encode`` builds it for the actor."""
    return encode_prompt(tokenizer, system, question, syntax)


def _segment_ids(tokenizer: Any, role: str, text: str, syntax: Any) -> list[int]:
    """A segment's ids. Traces are written in ARPO's tags (the synthetic suite); under
    tools.syntax=hermes a model segment's closing call is rewritten as a JSON call and a
    tool segment becomes the template's tool message, as the rollout inserts it. A tool
    segment is re-inserted through the syntax in both, so the output's control tokens
    are defused as the rollout defuses them (toolenv.tags.defuse)."""
    if role == "tool":
        return syntax.result_ids(unwrap_result(text))
    if not syntax.templated:
        return tokenizer.encode(text, add_special_tokens=False)
    call = find_tool_call(text)
    if call is not None:
        text = (text[:text.rstrip().rfind(f"<{call.name}>")]
                + syntax.call_text(call.name, call.args))
    return tokenizer.encode(text, add_special_tokens=False)


def encode_trace(tokenizer: Any, row: dict, where: str = "trace",
                 syntax: Any = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one trace: prompt (mask 0), segments encoded one by one
    (model 1, tool 0), then EOS (1). ``syntax``: the rollout's ``ToolSyntax`` (None:
    the trace's own ARPO tags, no custom tools)."""
    segments = row.get("segments")
    if not isinstance(segments, list) or not segments:
        raise SFTDataError(f"{where}: no 'segments' list")
    if not isinstance(row.get("question"), str):
        raise SFTDataError(f"{where}: no 'question'")
    syntax = syntax or ArpoSyntax((), tokenizer)  # the rollout's default: ARPO's tags
    ids = prompt_ids(tokenizer, row.get("system"), row["question"], syntax)
    mask = [0] * len(ids)
    for j, seg in enumerate(segments):
        role, text = seg.get("role"), seg.get("text")
        if role not in ("model", "tool") or not isinstance(text, str):
            raise SFTDataError(f"{where}: segment {j}: expected role model|tool and a text")
        seg_ids = _segment_ids(tokenizer, role, text, syntax)
        ids += seg_ids
        mask += [1 if role == "model" else 0] * len(seg_ids)
    if segments[-1]["role"] != "model" or not segments[-1]["text"].rstrip().endswith("</answer>"):
        raise SFTDataError(f"{where}: the last segment must be model text ending in </answer>")
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids, mask


def load_traces(path: str | Path, tokenizer: Any, max_len: int,
                syntax: Any = None) -> list[tuple[list[int], list[int]]]:
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"{path}: file not found")
    out = []
    for n, row in iter_jsonl(path, SFTDataError):
        ids, mask = encode_trace(tokenizer, row, f"{path}: row {n}", syntax)
        if len(ids) > max_len:
            raise SFTDataError(f"{path}: row {n}: {len(ids)} tokens > max_len={max_len}")
        out.append((ids, mask))
    if not out:
        raise SFTDataError(f"{path}: no traces")
    return out


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any]:
    """Right-padded [B, T] ids and loss mask (pads get mask 0). No attention mask is
    needed: with causal attention, right padding never reaches a real position."""
    import torch  # torch: heavy; not for --help nor for the launcher

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.float32)
    for i, (seq, m) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def masked_lm_loss(model: Any, ids: Any, mask: Any, chunk: int = 512
                   ) -> tuple[Any, dict[str, float]]:
    """Mean next-token cross-entropy of ``model`` over the positions whose *target* has
    mask 1 (ids[:, 1:] predicted from ids[:, :-1]), with the output layer applied only to
    those positions, ``chunk`` at a time (arpo_async/core/logits.py): no [B, T, V] logits.
    Returns (loss, {"tokens", "accuracy"}), accuracy = greedy hits among the targets."""
    from arpo_async.core.logits import causal_lm_logprobs  # it imports torch: not for --help

    select = mask[:, 1:] > 0
    stats = causal_lm_logprobs(model, ids, select, chunk=chunk, hit=True)
    count = max(int(select.sum()), 1)
    loss = -stats.logp.sum() / count
    return loss, {"tokens": float(select.sum()), "accuracy": float(stats.hit.sum()) / count}


def lr_factor(progress: float, warmup_frac: float = 0.05, min_lr_frac: float = 0.1) -> float:
    """Linear warm-up over ``warmup_frac`` of the budget, then cosine down to
    ``min_lr_frac`` of the peak rate (``pipeline.sft_warmup_frac``,
    ``pipeline.sft_min_lr_frac``)."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup_frac:
        return max(progress / warmup_frac, 0.01)
    cos = 0.5 * (1 + math.cos(math.pi * (progress - warmup_frac) / (1 - warmup_frac)))
    return min_lr_frac + (1 - min_lr_frac) * cos


def mean_loss(model: Any, data: list, pad_id: int, batch_size: int = 16,
              chunk: int = 512) -> float:
    """Model-token loss of ``data`` (no gradient), weighted by tokens."""
    import torch

    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            ids, mask = collate(data[i:i + batch_size], pad_id)
            loss, m = masked_lm_loss(model, ids, mask, chunk)
            total += float(loss) * m["tokens"]
            count += m["tokens"]
    return total / max(count, 1.0)


# ----------------------------------------------------------------------------- training


def save_checkpoint(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write to OUT.tmp, fsync every file, then swap it in for OUT."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    os.rename(tmp, out)
    dir_fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    shutil.rmtree(old, ignore_errors=True)
    return out


class _Batches:
    """Seeded epochs: a fresh permutation of the traces per epoch, ``size`` at a time
    (the short tail of an epoch is skipped, so every batch has the same size).

    With ``lengths``, batches are grouped by length: each epoch's permutation is cut into
    chunks of ``GROUP_BATCHES`` batches, each chunk sorted by length and cut into batches,
    and the batches shuffled. Right padding then costs little (the suite's traces are 93
    to 290 tokens: random batches were padded to 1.8x the tokens they hold)."""

    GROUP_BATCHES = 8

    def __init__(self, n: int, size: int, rng: np.random.Generator,
                 lengths: list[int] | None = None):
        self.n, self.size, self.rng = n, min(size, n), rng
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.queue: list[np.ndarray] = []

    def _epoch(self) -> list[np.ndarray]:
        order = self.rng.permutation(self.n)
        usable = self.n - self.n % self.size
        if self.lengths is None:
            return [order[i:i + self.size] for i in range(0, usable, self.size)]
        chunk = self.size * self.GROUP_BATCHES
        batches = []
        for i in range(0, usable, chunk):
            part = order[i:min(i + chunk, usable)]
            part = part[np.argsort(self.lengths[part], kind="stable")]
            batches += [part[j:j + self.size] for j in range(0, len(part), self.size)]
        return [batches[k] for k in self.rng.permutation(len(batches))]

    def next(self) -> np.ndarray:
        if not self.queue:
            self.queue = self._epoch()[::-1]
        return self.queue.pop()


def _train_step(model: Any, opt: Any, ids: Any, mask: Any, chunk: int,
                dtype: str = "float32") -> tuple[float, float]:
    """One AdamW step; ``dtype``: the compute dtype (bfloat16: autocast over the float32
    weights)."""
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss, m = masked_lm_loss(model, ids, mask, chunk)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach()), m["accuracy"]


def _traces(data_path: str | Path, tokenizer: Any, max_len: int, tools: Any,
            template_kwargs: dict | None) -> list:
    """The traces encoded in the run's tool syntax (None: ARPO's tags as written)."""
    syntax = None
    if tools is not None or template_kwargs:
        syntax = build_syntax(tools or ToolsConfig(), tokenizer, template_kwargs)
    return load_traces(data_path, tokenizer, max_len, syntax)


def run_sft(model_dir: str | Path, data_path: str | Path, out_dir: str | Path,
            steps: int | None = None, time_budget_s: float | None = None, lr: float = 2e-3,
            batch_size: int = 16, seed: int = 0, threads: int = 2, weight_decay: float = 0.0,
            max_len: int = 512, log: Callable[[str], None] | None = None,
            warmup_frac: float = 0.05, min_lr_frac: float = 0.1, tools: Any = None,
            template_kwargs: dict | None = None, chunk: int = 512,
            dtype: str = "float32") -> dict:
    """Fine-tune ``model_dir`` on the traces in ``data_path``; save to ``out_dir``.
    Stops after ``steps`` or ``time_budget_s`` seconds of training, whichever comes
    first (at least one must be given); the learning-rate schedule runs over ``steps``
    when given, else over the time budget. ``tools``: the run's ``ToolsConfig``, so the
    traces are encoded in its ``tools.syntax`` with its tools (None: ARPO's tags as
    written); ``template_kwargs``: extra chat-template arguments (``model.chat_template_kwargs``);
    ``chunk``: targets per output-layer pass (``pipeline.sft_logprob_chunk_tokens``);
    ``dtype``: the compute dtype (``pipeline.sft_dtype``). Returns the run's figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: heavy

    if not steps and not time_budget_s:
        raise ValueError("run_sft: give steps or time_budget_s")
    log = log or functools.partial(print, flush=True)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    data = _traces(data_path, tokenizer, max_len, tools, template_kwargs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay)
    batches = _Batches(len(data), batch_size, np.random.default_rng(seed),
                       lengths=[len(ids) for ids, _ in data])
    cpu0 = time.process_time()  # CPU seconds: comparable between loaded and idle machines
    t0 = last_log = time.perf_counter()
    step, tokens, window, history = 0, 0, [], []
    while True:
        elapsed = time.perf_counter() - t0
        if (steps and step >= steps) or (time_budget_s and elapsed >= time_budget_s):
            break
        for group in opt.param_groups:
            progress = step / steps if steps else elapsed / time_budget_s
            group["lr"] = lr * lr_factor(progress, warmup_frac, min_lr_frac)
        ids, mask = collate([data[i] for i in batches.next()], pad)
        window.append(_train_step(model, opt, ids, mask, chunk, dtype))
        step, tokens = step + 1, tokens + ids.numel()
        # step 1 is always a line of its own: loss_first is the loss before any update
        if time.perf_counter() - last_log >= LOG_EVERY_S or step in (1, steps):
            history.append(_log_line(log, step, steps, window, opt, tokens,
                                     time.perf_counter() - t0, time_budget_s))
            window, last_log = [], time.perf_counter()
    if window:
        history.append(_log_line(log, step, steps, window, opt, tokens,
                                 time.perf_counter() - t0, time_budget_s))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = save_checkpoint(model.eval(), tokenizer, out_dir)
    return {"out": str(out), "steps": step, "train_s": round(wall, 1),
            "train_cpu_s": round(cpu, 1), "save_s": round(time.perf_counter() - t0 - wall, 2),
            "traces": len(data), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            "accuracy_last": history[-1]["accuracy"], "history": history}


def _log_line(log: Callable[[str], None], step: int, steps: int | None, window: list,
              opt: Any, tokens: int, elapsed: float, budget: float | None) -> dict:
    loss = float(np.mean([w[0] for w in window]))
    acc = float(np.mean([w[1] for w in window]))
    total = f"/{steps}" if steps else ""
    limit = f"/{budget:.0f}" if budget else ""
    log(f"[sft] step {step}{total}  loss {loss:.4f}  model-token acc {acc:.3f}  "
        f"lr {opt.param_groups[0]['lr']:.2e}  {tokens / elapsed:.0f} tok/s  "
        f"{elapsed:.0f}{limit} s")
    return {"step": step, "loss": round(loss, 4), "accuracy": round(acc, 4),
            "elapsed_s": round(elapsed, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Cold-start SFT on tool-use traces (CPU).")
    ap.add_argument("--model", required=True, help="Hugging Face model folder to start from")
    ap.add_argument("--data", required=True, help="sft.jsonl written by arpo_async.jobs.synthetic")
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps")
    ap.add_argument("--time-budget-s", type=float, default=None, help="training seconds")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    ap.add_argument("--batch-size", type=int, default=16, help="traces per step")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--max-len", type=int, default=512, help="longest trace, tokens")
    ap.add_argument("--chunk-tokens", type=int, default=512,
                    help="targets per output-layer pass (0: all at once)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype (bfloat16: autocast over float32 master weights)")
    args = ap.parse_args(argv)
    if not args.steps and not args.time_budget_s:
        ap.error("give --steps or --time-budget-s")
    result = run_sft(args.model, args.data, args.out, steps=args.steps,
                     time_budget_s=args.time_budget_s, lr=args.lr, batch_size=args.batch_size,
                     seed=args.seed, threads=args.threads, weight_decay=args.weight_decay,
                     max_len=args.max_len, chunk=args.chunk_tokens, dtype=args.dtype)
    result.pop("history")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
