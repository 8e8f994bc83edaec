#!/usr/bin/env bash
# The configuration searches quoted in docs/scale.md: the Megatron-LM paper's qualitative findings
# and BERT-Large / GPT-3 175B on 512-3072 A100s with and without K-FAC. Writes the tables and JSON
# under docs/scale-results/.
# Usage: scripts/scale_searches.sh [path/to/pipefisher_sim]
set -euo pipefail
SIM=${1:-build/release/sim/cli/pipefisher_sim}
OUT=docs/scale-results
DEVICE=sim/calibration/a100_megatron.json
mkdir -p "$OUT"
run() {  # name, then the search flags
  local name=$1
  shift
  echo "pipefisher_sim search $*" > "$OUT/$name.txt"
  "$SIM" search "$@" --out "$OUT/$name.json" >> "$OUT/$name.txt"
}
# Findings 1 and 2 reproduce the paper's setting: replicated state, no offload (as in its Table 1).
MEGATRON_STATE=(--zero-stages 0 --optimizer-offload none)
# Finding 1: tensor parallelism inside a node (the 145.6B row, t up to 16, two nodes).
run tp_145b --model megatron-145.6b --gpus 1536 --global-batch 2304 --cluster dgx-a100 \
  --device "$DEVICE" --precision fp16 --top 400 --simulate-top 64 "${MEGATRON_STATE[@]}"
# Finding 2: interleaving helps at small batch (GPT-3 175B, t = 8, p = 16 on 1024 GPUs).
for batch in 128 512 2048; do
  for schedules in 1f1b interleaved; do
    run "batch_${batch}_${schedules}" --model gpt3-175b --gpus 1024 --global-batch "$batch" \
      --cluster dgx-a100 --device "$DEVICE" --precision fp16 --tensor-parallel 8 --stages 16 \
      --schedules "$schedules" --top 3 "${MEGATRON_STATE[@]}"
  done
done
# Finding 3 and the K-FAC comparison: BERT-Large (phase 1) and GPT-3 175B on 512-3072 GPUs, with
# the search's whole space (ZeRO stages 0-3, optimizer state on the GPU or in host memory).
for gpus in 512 1024 3072; do
  run "bert_large_${gpus}" --model bert-large --seq-len 128 --gpus "$gpus" --global-batch 65536 \
    --cluster dgx-a100 --device "$DEVICE" --precision fp16 --top 5 --kfac --kfac-top 5
  run "gpt3_175b_${gpus}" --model gpt3-175b --gpus "$gpus" --global-batch 1536 \
    --cluster dgx-a100 --device "$DEVICE" --precision fp16 --top 5 --kfac --kfac-top 3
done
