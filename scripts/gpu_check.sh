#!/usr/bin/env bash
# The checks that need a GPU, in one script, within 10 minutes on a node with an NVIDIA GPU:
#   1. the GPU and driver (nvidia-smi)
#   2. the `gpu` extra (vLLM) in .venv-gpu, unless it is already there (needs PyPI, or a prepared .venv-gpu)
#   3. the sampler contract suite on every backend, vLLM included (tests/test_sampler_contract.py)
#   4. `slm-bench bench backends`: vLLM against our HF backend on the same checkpoint and GPU
#   5. the TinyGSM recipe of the smoke profile on the GPU, every stage sampling with vLLM (--set sample.backend=vllm:
#      each sampler a snapshot engine, one at a time), then `slm-bench plan --profile gpu` with the peak that run's
#      environment stage measured on this GPU and vLLM's engine counted against the GPU's memory
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: runs/gpu-check); everything it prints is also in OUT_DIR/gpu_check.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
VENV=${VENV:-.venv-gpu}
start=$(date +%s)
step() { echo; echo "=== $1 ($(( $(date +%s) - start )) s)"; }
status=0

step "1. GPU"
if ! nvidia-smi; then echo "no NVIDIA GPU here: nothing to check"; exit 2; fi

step "2. the gpu extra in $VENV"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, slm_bench" 2>/dev/null; then
  echo "already installed: vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
else
  python3 -m venv "$VENV" && timeout 420 "$VENV/bin/pip" install --quiet -e ".[gpu,dev]" \
    || { echo "could not install the gpu extra (no PyPI from here?): prepare $VENV on a machine with access"; exit 2; }
fi
"$VENV/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, torch.cuda.get_device_name(0))"
"$VENV/bin/jupyter" kernelspec install kernels/slm-bench --sys-prefix --replace >/dev/null

step "3. sampler contract suite, every backend (vLLM included)"
timeout 240 "$VENV/bin/python" -m pytest tests/test_sampler_contract.py -q -rs -p no:cacheprovider || status=1

step "4. bench backends: vLLM against HF on one GPU"
timeout 180 "$VENV/bin/slm-bench" bench backends || status=1

step "5. the smoke profile's TinyGSM recipe on the GPU, sampling with vLLM, then plan --profile gpu with its measured peak"
timeout 360 "$VENV/bin/slm-bench" run --profile smoke --recipe tinygsm --set sample.backend=vllm --set environment.device=cuda \
  --set "environment.sizes=[1024, 2048, 4096]" --run-dir "$OUT/smoke" --no-report --jobs 1 || status=1
"$VENV/bin/python" -c "import json; s = json.load(open('$OUT/smoke/summary.json')); print({k: v for k, v in s.get('metrics', {}).items() if 'pass' in k})" || status=1
gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%.0f", $1 / 1024}')
"$VENV/bin/slm-bench" plan --profile gpu --run-dir "$OUT/smoke" --recipe tinygsm --set sample.backend=vllm --gpu-mem "$gpu_gib" || status=1

step "done: exit $status"
exit $status
