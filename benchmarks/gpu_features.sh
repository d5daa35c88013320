#!/usr/bin/env bash
# This wave's features end to end on one CUDA GPU, tiny model, HF engine, 6 steps each at seed 1: grpo padded and
# packed (--micro-batch-tokens), LoRA, --max-lag 2, ppo packed; then the quick start (`python algos/grpo.py`, 60
# steps). Prints, per run, the exit code, wall time and a summary of metrics.jsonl (step-1 loss and gradient norm,
# train/logprob_gap, rewards, peak GPU memory, median step time, lags, held-out evaluations).
#
#     OUT=/some/folder bash benchmarks/gpu_features.sh     # on the GPU machine, after gpu_check's wheels are installed
#
# Results of 2026-11-24 on one H100: benchmarks/results/gpu/features.txt.
set -u
OUT="${OUT:-/tmp/gpu_features}"
RUNS="$(mktemp -d)"
trap 'rm -rf "$RUNS"' EXIT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
SMALL="--rollout.backend hf --total-steps 6 --prompts-per-step 8 --group-size 4 --max-new-tokens 32 \
--eval.max-problems 16 --eval.n 2 --eval.k 1 2 --eval-every 100 --save-every 100 --seed 1 --output-dir $RUNS"
summary() {
  python3 - "$RUNS/$1/metrics.jsonl" <<'PY'
import json, statistics, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in rows if "train/reward" in r]
evals = [(r["step"], {k: round(v, 3) for k, v in r.items() if "mean@" in k}) for r in rows if any("mean@" in k for k in r)]
print(" step1 loss", train[0].get("train/loss"), "grad_norm", train[0].get("train/grad_norm"))
print(" logprob_gap", [round(r.get("train/logprob_gap", float("nan")), 5) for r in train])
print(" reward", [round(r["train/reward"], 3) for r in train])
peak = max(r.get("memory/peak_gpu_gb", 0) for r in train)
print(" peak_gpu_gb", peak, "median step_s", round(statistics.median(r["time/step_s"] for r in train), 3), "steps", len(train))
print(" lag", [r.get("train/lag_max") for r in train])
print(" eval", evals)
PY
}
run() {
  local name=$1 t0=$SECONDS
  shift
  timeout 200 python3 "$@" --run-name "$name" >>"$OUT/logs.txt" 2>&1
  local rc=$?
  # the scratch runs folder is written as $RUNS, so committed results name no machine path
  echo "== $name: ${*//$RUNS/\$RUNS} rc=$rc wall=$((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  summary "$name" >>"$OUT/summary.txt" 2>&1
}
run base algos/grpo.py $SMALL
run packed algos/grpo.py $SMALL --micro-batch-tokens 256
run lora algos/grpo.py $SMALL --lora.rank 8 --learning-rate 1e-3
run lag2 algos/grpo.py $SMALL --max-lag 2
run ppo_packed algos/ppo.py $SMALL --micro-batch-tokens 256
run quickstart algos/grpo.py --output-dir "$RUNS"
cat "$OUT/summary.txt"
