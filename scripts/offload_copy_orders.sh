#!/usr/bin/env bash
# The offload pass's two copy orders side by side (docs/offload.md, "Placing the copies"): for
# each configuration, the step-time overhead of the offload and the highest worker's peak with
# --kfac-offload-copies by-deadline, prefetches-latest-first and best (what the pass keeps).
# Usage: scripts/offload_copy_orders.sh [path/to/pipefisher_sim]
set -euo pipefail
sim=${1:-build/release/sim/cli/pipefisher_sim}
[[ -x $sim ]] || { echo "offload_copy_orders.sh: no pipefisher_sim at $sim (build it or pass its path)" >&2; exit 2; }
# --stash eager: the activation count docs/offload.md's table was taken with (before 2026-11-28).
h100_large=(--model large --device h100 --kfac --grid none --stash eager)
node_large=(--model large --seq-len 128 --precision bf16 --cluster dgx-h100 --kfac --grid none)
configurations=(
  "BERT-Large h100, 1F1B p=8, m=32, b=32, host|--schedule 1f1b -p 8 -m 32 --micro-batch-size 32 ${h100_large[*]} --kfac-offload host"
  "BERT-Large h100, Chimera p=8, m=8, b=32, host|--schedule chimera -p 8 -m 8 --micro-batch-size 32 ${h100_large[*]} --kfac-offload host"
  "... auto, budget 6500 MiB|--schedule chimera -p 8 -m 8 --micro-batch-size 32 ${h100_large[*]} --kfac-offload auto --device-memory-budget 6500"
  "BERT-Large h100, 1F1B p=4, m=8, d=2, replicate, host|--schedule 1f1b --stages 4 --microbatches 8 ${h100_large[*]} --data-parallel 2 --kfac-sharding replicate --kfac-offload host"
  "... shard, host|--schedule 1f1b --stages 4 --microbatches 8 ${h100_large[*]} --data-parallel 2 --kfac-sharding shard --kfac-offload host"
  "BERT-Large dgx-h100, 1F1B p=8, m=8, b=8, host|--schedule 1f1b -p 8 -m 8 --micro-batch-size 8 ${node_large[*]} --kfac-offload host"
  "... b=32|--schedule 1f1b -p 8 -m 8 --micro-batch-size 32 ${node_large[*]} --kfac-offload host"
  "BERT-Large h100, GPipe p=4, m=8, b=16, host|--schedule gpipe -p 4 -m 8 --micro-batch-size 16 ${h100_large[*]} --kfac-offload host"
  "... interleaved v=2|--schedule interleaved -p 4 -m 8 --chunks 2 --micro-batch-size 16 ${h100_large[*]} --kfac-offload host"
  "... 1F1B, pipelined refresh|--schedule 1f1b -p 4 -m 8 --micro-batch-size 16 ${h100_large[*]} --kfac-pipelined-refresh on --kfac-offload host"
  "GPT-3 6.7B dgx-a100, 1F1B p=4, m=4, d=8, replicate, host|--model gpt3-6.7b --schedule 1f1b --stages 4 --microbatches 4 --micro-batch-size 1 --seq-len 2048 --cluster dgx-a100 --precision fp16 --recompute full --data-parallel 8 --kfac --kfac-offload host --grid none"
)
echo "| configuration | by deadline | prefetches latest first | best keeps |"
echo "|---|---|---|---|"
for entry in "${configurations[@]}"; do
  name=${entry%%|*}
  read -r -a arguments <<<"${entry#*|}"
  row="| $name"
  for order in by-deadline prefetches-latest-first best; do
    line=$("$sim" "${arguments[@]}" --kfac-offload-copies "$order" | grep 'Linears offloaded')
    overhead=$(sed -E 's/.*ms \(([^)]*)\); peak.*/\1/' <<<"$line")
    peak=$(sed -E 's/.*peak device memory [0-9.]+ MiB -> ([0-9.]+ MiB).*/\1/' <<<"$line")
    if [[ $order == best ]]; then
      row+=" | $(sed -E 's/.*copies placed ([a-z-]+).*/\1/' <<<"$line")"
    else
      row+=" | $overhead, $peak"
    fi
  done
  echo "$row |"
done
