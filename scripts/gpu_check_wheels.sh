#!/usr/bin/env bash
# Download the wheels an offline GPU machine lacks for benchmarks/gpu_check.py, and print the one command that
# installs them there and runs the check.
#
#     bash scripts/gpu_check_wheels.sh              # into gpu_wheels/ (git-ignored), for CPython 3.12 on x86-64 Linux
#     PYVER=3.11 bash scripts/gpu_check_wheels.sh   # another Python on the GPU machine
#
# The GPU machines this project is lent have PyTorch (CUDA 13), transformers and accelerate, but not tyro (the
# scripts' flags), math-verify (the verifiers) or peft (LoRA); vLLM is not needed (the check uses the HF engine). The wheels are a
# few MB, so they travel with the source (the device tool carries up to 64 MiB).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/gpu_wheels}"
PYVER="${PYVER:-3.12}"
mkdir -p "$DIR"
python -m pip download --quiet --dest "$DIR" --only-binary=:all: --python-version "$PYVER" \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "tyro>=1.0" "math-verify[antlr4_13_2]>=0.8"
# peft alone: its dependencies (torch, transformers, accelerate, ...) are the machine's own
python -m pip download --quiet --dest "$DIR" --no-deps "peft==0.21.2"
echo "downloaded to $DIR: $(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1)"
cat <<MSG

On the GPU machine, from the repo root (with $(basename "$DIR")/ beside it):

    python3 -m pip install --no-index --find-links $(basename "$DIR") tyro "math-verify[antlr4_13_2]" peft && python3 benchmarks/gpu_check.py

MSG
