"""Benchmark: delta weight sync (``learner.weight_sync.channel=delta``) against full copies
(``zmq``). ``python bench/delta_sync.py`` prints and writes bench/results/delta_sync.json.

1. **A 0.5B-parameter model's updates** (``--model``): a randomly initialised Qwen3 of
   Qwen2.5-0.5B's shape (hidden 896, 24 layers, MLP 4864, vocabulary 151,936, tied
   embeddings: 494M parameters) trained as DeepSpeed's bf16 mode trains (bf16 module,
   forward and backward in bf16, fp32 master weights and AdamW), one real
   forward/backward per step on random token sequences (``--tokens``), ``--steps``
   optimizer steps from the same initialisation at each learning rate of ``--lrs``
   (1e-6: ARPO's actor learning rate; 5e-5: this project's default job). After each step
   the bf16 weights are published on the real ``DeltaWeightSender`` and on the real
   ``ZmqWeightSender`` and pulled through the wire format (encode, bytes, decode) by a
   ``DeltaWeightReceiver`` and a ``ZmqWeightReceiver`` into a transformers model of the
   same shape (the HF engine's load: ``torch_state_dict`` then ``load_state_dict``).
   Per step: the share of bf16 values that changed, bytes of the reply (delta step
   against full copy), the learner's publish time, the actor's time before the load
   (fetch, decode, apply, checksums) and the pause (the load).
2. **The default job in bf16** (``--job``, off with ``--job none``): ``python -m
   arpo_async.launch`` (configs/default.yaml: data, tiny model, SFT, evaluation, RL,
   evaluation) with ``model.dtype=bfloat16``, once per channel of ``--job`` (default
   ``delta,zmq``), each in ``--out``/job_<channel> (a finished one is read back). From the
   delta run's summary: bytes served against what full copies would have cost for the
   same loads, the share of values changed per step; from both: the actors' mean pause
   per weight load and the held-out accuracy.

The last line is ``RESULT delta_sync bytes_ratio=<default job> pause_ratio=<default job:
delta pause per load / zmq's> changed_share=<default job> lr=<its learning rate>
bytes_ratio_05b=<at lr 1e-6> changed_share_05b=<at lr 1e-6> target=bytes_ratio<=0.25``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, SCRATCH_DIR, write_results  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="0.5b", choices=("0.5b", "none"),
                   help="the 0.5B part (none: skip it)")
    p.add_argument("--lrs", default="1e-6,5e-5", help="learning rates of the 0.5B part")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per learning rate")
    p.add_argument("--tokens", type=int, default=256, help="tokens per step (2 sequences)")
    p.add_argument("--job", default="delta,zmq",
                   help="channels to run the default job with, in bf16 (none: skip)")
    p.add_argument("--out", default=f"{SCRATCH_DIR}/delta_sync", help="run folders")
    p.add_argument("--results", default=None, help="JSON output (bench/results/delta_sync.json)")
    return p.parse_args()


# ------------------------------------------------------------------ 1. the 0.5B model
def qwen3_05b():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096)


class Wire:
    """One sender behind the real wire format: the reply's frames copied as a socket
    would deliver them, then decoded."""

    def __init__(self, sender):
        self.sender, self.bytes = sender, 0

    async def request(self, msg):
        from arpo_async.core import protocol as P

        reply = self.sender.handle(P.decode(P.encode(msg)))
        frames = [bytes(f) for f in (reply.frames if hasattr(reply, "frames")
                                     else P.encode(reply))]
        self.bytes += sum(len(f) for f in frames)
        return P.decode(frames, max_bytes=1 << 40)  # the actors raise theirs to the model


class LoadEngine:
    """The HF engine's load (actors/engines/hf_engine.py) without its gate: the pause."""

    def __init__(self, model):
        self.model, self.version, self.load_s = model, 0, 0.0

    async def update_weights(self, tensors, version):
        import torch

        from actors.engines.base import torch_state_dict

        t0 = time.perf_counter()
        state = torch_state_dict(tensors, torch.bfloat16)
        self.model.load_state_dict(state, strict=False)
        self.version, self.load_s = version, time.perf_counter() - t0
        return self.load_s


def model_part(lr: float, steps: int, tokens: int) -> list[dict]:
    import torch
    from transformers import Qwen3ForCausalLM

    from arpo_async.core.weights.delta import DeltaWeightReceiver, DeltaWeightSender
    from arpo_async.core.weights.zeromq import ZmqWeightReceiver, ZmqWeightSender

    torch.manual_seed(0)
    config = qwen3_05b()
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    params = [p for p in model.parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=lr, weight_decay=0.0)
    engine = LoadEngine(Qwen3ForCausalLM(config).to(torch.bfloat16))
    senders = {"delta": DeltaWeightSender(keep=4), "zmq": ZmqWeightSender()}
    receivers = {"delta": DeltaWeightReceiver(Wire(senders["delta"]), 0),
                 "zmq": ZmqWeightReceiver(Wire(senders["zmq"]), 0)}
    g = torch.Generator().manual_seed(1)
    rows = []
    for version in range(steps + 1):
        if version:  # one real step: bf16 forward/backward, fp32 AdamW, bf16 copy back
            t0 = time.perf_counter()
            ids = torch.randint(0, config.vocab_size, (2, tokens // 2), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            for m, p in zip(master, params):
                m.grad = p.grad.float()
            model.zero_grad(set_to_none=True)
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)
                    m.grad = None
            train_s = time.perf_counter() - t0
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        row = {"lr": lr, "version": version, "params": sum(t.numel() for t in state.values())}
        for name in ("delta", "zmq"):
            t0 = time.perf_counter()
            senders[name].publish(version, state)
            row[f"{name}_publish_s"] = time.perf_counter() - t0
        for name in ("delta", "zmq"):
            rx, wire = receivers[name], receivers[name].control
            before, engine.load_s = wire.bytes, 0.0
            engine.version = version - 1  # each arm's receiver holds the version before
            t0 = time.perf_counter()
            loaded = asyncio.run(rx.sync(engine))
            total = time.perf_counter() - t0
            assert loaded is not None and engine.version == version, (name, version)
            row[f"{name}_bytes"] = wire.bytes - before
            row[f"{name}_pause_s"] = engine.load_s
            row[f"{name}_actor_s"] = total - engine.load_s  # fetch, decode, apply, checks
        if version:
            stats = senders["delta"].stats()
            row |= {"train_s": train_s, "changed_share": stats["changed_share_last"],
                    "bytes_ratio": row["delta_bytes"] / row["zmq_bytes"],
                    "pause_ratio": row["delta_pause_s"] / row["zmq_pause_s"]}
            # the engine holds the learner's weights, bit for bit
            got = engine.model.state_dict()
            assert all(torch.equal(got[n], t) for n, t in state.items()), version
        rows.append(row)
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
    del model, master, opt, engine, senders, receivers
    gc.collect()
    return rows


def summarize_model(rows: list[dict]) -> dict:
    out = {}
    for lr in sorted({r["lr"] for r in rows}):
        steps = [r for r in rows if r["lr"] == lr and r["version"] > 0]
        out[f"{lr:g}"] = {k: statistics.median(r[k] for r in steps) for k in (
            "changed_share", "bytes_ratio", "pause_ratio", "delta_bytes", "zmq_bytes",
            "delta_publish_s", "zmq_publish_s", "delta_actor_s", "zmq_actor_s",
            "delta_pause_s", "zmq_pause_s")} | {"steps": len(steps)}
    return out


# ------------------------------------------------------------------ 2. the default job
def job_part(channel: str, out: Path) -> dict:
    run_dir = out / f"job_{channel}"
    summary_path = run_dir / "summary.json"
    if not (summary_path.exists() and "accuracy_after_rl" in json.loads(
            summary_path.read_text())):
        cmd = [sys.executable, "-m", "arpo_async.launch", f"run.dir={run_dir}",
               "model.dtype=bfloat16", f"learner.weight_sync.channel={channel}",
               f"model.path={out / 'tiny_model'}", f"pipeline.data_dir={out / 'data'}",
               f"task.data={out / 'data' / 'rl.jsonl'}"]
        print(f"default job, bf16, channel {channel}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        res = subprocess.run(cmd, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)})
        if res.returncode:
            raise SystemExit(f"the default job with channel {channel} failed "
                             f"(rc {res.returncode}): see {run_dir}")
        print(f"  done in {time.time() - t0:.0f} s", flush=True)
    return job_figures(run_dir, channel)


def job_figures(run_dir: Path, channel: str) -> dict:
    from arpo_async.core.config import load_config

    summary = json.loads((run_dir / "summary.json").read_text())
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    weights = learner["service"]["weights"]
    actors = summary["learner"]  # the actors' own figures, "actorN/..."
    loads = sum(v for k, v in actors.items() if k.endswith("/weight_updates"))
    pause = sum(v for k, v in actors.items() if k.endswith("/pause_s"))
    cfg = load_config(str(run_dir / "config.yaml"), [])
    return {"channel": channel, "weights": weights.get(channel, {}),
            "zmq": weights.get("zmq", {}), "weight_loads": loads,
            "pause_per_load_s": pause / max(loads, 1), "lr": cfg.learner.lr,
            "steps": summary.get("steps"), "accuracy_after_sft": summary.get(
                "accuracy_after_sft"), "accuracy_after_rl": summary.get("accuracy_after_rl")}


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict = {"args": vars(args)}
    if args.model != "none":
        rows = []
        for lr in [float(x) for x in args.lrs.split(",")]:
            rows += model_part(lr, args.steps, args.tokens)
        data["model_05b"] = {"rows": rows, "median": summarize_model(rows)}
    if args.job != "none":
        data["job"] = {c: job_part(c, out) for c in args.job.split(",")}
    write_results("delta_sync", data, args.results)
    return report(data)


def report(data: dict) -> int:
    fig = {}
    if "model_05b" in data:
        for lr, m in data["model_05b"]["median"].items():
            print(f"0.5B, lr {lr}: changed {m['changed_share']:.4f} of the values; step "
                  f"{m['delta_bytes'] / 1e6:.1f} MB against {m['zmq_bytes'] / 1e6:.1f} MB "
                  f"(ratio {m['bytes_ratio']:.3f}); publish {m['delta_publish_s']:.2f} s "
                  f"(full {m['zmq_publish_s']:.2f} s); actor before the load "
                  f"{m['delta_actor_s']:.2f} s (full {m['zmq_actor_s']:.2f} s); pause "
                  f"{m['delta_pause_s']:.2f} s (full {m['zmq_pause_s']:.2f} s)")
        first = data["model_05b"]["median"].get("1e-06")
        if first:
            fig |= {"bytes_ratio_05b": first["bytes_ratio"],
                    "changed_share_05b": first["changed_share"]}
    job = data.get("job", {})
    if "delta" in job:
        d = job["delta"]
        w = d["weights"]
        fig |= {"bytes_ratio": w["bytes_ratio"], "changed_share": w["changed_share"],
                "lr": d["lr"]}
        print(f"default job, bf16, lr {d['lr']:g}: delta served {w['bytes_served'] / 1e6:.1f}"
              f" MB where full copies cost {w['bytes_full_equivalent'] / 1e6:.1f} MB "
              f"(ratio {w['bytes_ratio']:.3f}; {w['steps_served']} steps, "
              f"{w['full_served']} full copies); changed share {w['changed_share']:.3f}; "
              f"pause per load {d['pause_per_load_s'] * 1e3:.1f} ms; held-out "
              f"{d['accuracy_after_sft']} -> {d['accuracy_after_rl']}")
        if "zmq" in job:
            z = job["zmq"]
            fig["pause_ratio"] = d["pause_per_load_s"] / max(z["pause_per_load_s"], 1e-9)
            print(f"default job, bf16, zmq: pause per load {z['pause_per_load_s'] * 1e3:.1f} ms;"
                  f" served {z['zmq'].get('bytes_served', 0) / 1e6:.1f} MB; held-out "
                  f"{z['accuracy_after_sft']} -> {z['accuracy_after_rl']}")
    head = "bytes_ratio" if "bytes_ratio" in fig else "bytes_ratio_05b"
    if head not in fig:
        print("RESULT delta_sync nothing_measured=1 target=bytes_ratio<=0.25 missed")
        return 1
    met = fig[head] <= 0.25
    figures = " ".join(f"{k}={v:.4g}" for k, v in fig.items())
    print(f"RESULT delta_sync {figures} target=bytes_ratio<=0.25 {'met' if met else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
