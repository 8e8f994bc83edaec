#!/usr/bin/env bash
# The configuration search's closed-form memory estimate against the PipeFisher and offload
# passes' simulated peak, for the K-FAC finalists of a few searches, with and without K-FAC
# offload whole (host) and factors only (docs/scale.md; figures in docs/benchmarks.md).
# Usage: scripts/search_memory_estimate.sh [path/to/pipefisher_sim]
set -euo pipefail
sim=${1:-build/release/sim/cli/pipefisher_sim}
[[ -x $sim ]] || { echo "search_memory_estimate.sh: no pipefisher_sim at $sim (build it or pass its path)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
search() {  # label, search arguments...
  local label=$1
  shift
  for offload in none host factors; do
    "$sim" search "$@" --kfac --kfac-sharding replicate,shard --kfac-offload "$offload" \
      --top 4 --kfac-top 4 --out "$work/out.json" >/dev/null
    python3 - "$label" "$offload" "$work/out.json" <<'PY'
import json, sys
label, offload, path = sys.argv[1:]
for c in json.load(open(path))["candidates"]:
    kfac = c.get("kfac") or {}
    if "peak_memory_bytes" not in kfac:
        continue
    estimate, simulated = c["memory_estimate_bytes"], kfac["peak_memory_bytes"]
    print(f"| {label} | {offload} | {c['schedule']} p={c['stages']} d={c['data_parallel']} "
          f"b={c['micro_batch_size']} m={c['microbatches']} | {c['kfac_state']['placement']} | "
          f"{estimate / 2**30:.2f} GiB | {simulated / 2**30:.2f} GiB | "
          f"{100 * (estimate / simulated - 1):+.1f}% |")
PY
  done
}
echo "| search | --kfac-offload | configuration | K-FAC state | closed form | simulated | difference |"
echo "|---|---|---|---|---|---|---|"
search "GPT-3 6.7B, 32 A100s" --model gpt3-6.7b --gpus 32 --global-batch 32 --cluster dgx-a100 \
  --precision fp16 --tensor-parallel 1 --stages 4 --micro-batch-sizes 1 --schedules 1f1b \
  --recompute full --zero-stages 0 --optimizer-offload none
search "BERT-Large, 8 H100s" --model bert-large --gpus 8 --global-batch 256 --cluster dgx-h100 \
  --precision bf16 --tensor-parallel 1 --stages 4,8 --micro-batch-sizes 8,32 \
  --schedules 1f1b,gpipe --zero-stages 0 --optimizer-offload none
search "GPT-3 1.3B, 16 H100s" --model gpt3-1.3b --gpus 16 --global-batch 64 --cluster dgx-h100 \
  --precision bf16 --tensor-parallel 1,2 --stages 2,4 --micro-batch-sizes 1,2 --schedules 1f1b \
  --zero-stages 0 --optimizer-offload none
