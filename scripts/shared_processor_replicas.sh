#!/usr/bin/env bash
# The shared processor with data-parallel replicas (docs/benchmarks.md, "The self-profile with
# the cores shared"): pipefisher_train --kfac on the demo's configuration with two replicas
# (BERT-mini, 1F1B p = 2, --data-parallel 2, 8 micro-batches of 8 x 128, 10 steps), its
# predicted step time against the measured one, beside the prediction from the same profile
# with the whole capacity given to the simulated replica (the model before 2026-11-29):
#   scripts/shared_processor_replicas.sh TRAIN_BINARY DATA_SHARDS OUT_DIR [ROUNDS]
# Run it on an otherwise idle machine.
set -euo pipefail
if (($# < 3)); then sed -n '2,8p' "$0"; exit 2; fi
train=$1 data=$2 out=$3 rounds=${4:-2}
[[ -x $train ]] || { echo "shared_processor_replicas.sh: error: $train is not an executable" >&2; exit 2; }
[[ -d $data ]] || { echo "shared_processor_replicas.sh: error: no shard directory $data" >&2; exit 2; }
mkdir -p "$out"
args=(--model mini --data "$data" --schedule 1f1b --stages 2 --data-parallel 2 --microbatches 8
      --micro-batch-size 8 --lr 1e-2 --kfac --log-every 5)
for ((round = 1; round <= rounds; ++round)); do
  "$train" "${args[@]}" --steps 10 --kfac-profile-out "$out/share_$round.json" \
    > "$out/share_$round.log" 2>&1
  # The same profile, the whole capacity for the one simulated replica.
  python3 - "$out/share_$round.json" "$out/whole_$round.json" <<'PY'
import json, sys
profile = json.load(open(sys.argv[1]))
profile["shared_processor"]["capacity"] *= 2
json.dump(profile, open(sys.argv[2], "w"))
PY
  "$train" "${args[@]}" --steps 1 --kfac-profile "$out/whole_$round.json" \
    > "$out/whole_$round.log" 2>&1
done
grep -H -E "PipeFisher: K-FAC|measured over" "$out"/*.log
