#!/usr/bin/env bash
# Predicted against measured step time of pipefisher_train --kfac, two binaries alternating
# (docs/benchmarks.md, "The self-profile with the cores shared"):
#   scripts/shared_processor_ab.sh NEW_TRAIN_BINARY OLD_TRAIN_BINARY DATA_SHARDS OUT_DIR [ROUNDS]
# Each round runs NEW then OLD on the demo's configuration (BERT-mini, 1F1B p = 2, 8 micro-batches
# of 8 x 128, 16 steps), each writing the profile its pass used, then NEW with --steps 1 on OLD's
# profile (its summary prints that profile's predicted step times in seconds). Ends with the
# PipeFisher and "measured" lines of every run. Run it on an otherwise idle machine.
set -euo pipefail
if (($# < 4)); then sed -n '2,8p' "$0"; exit 2; fi
new=$1 old=$2 data=$3 out=$4 rounds=${5:-2}
for binary in "$new" "$old"; do
  [[ -x $binary ]] || { echo "shared_processor_ab.sh: error: $binary is not an executable" >&2; exit 2; }
done
[[ -d $data ]] || { echo "shared_processor_ab.sh: error: no shard directory $data" >&2; exit 2; }
mkdir -p "$out"
args=(--model mini --data "$data" --schedule 1f1b --stages 2 --microbatches 8
      --micro-batch-size 8 --lr 1e-2 --kfac --log-every 4)
for ((round = 1; round <= rounds; ++round)); do
  "$new" "${args[@]}" --steps 16 --kfac-profile-out "$out/new_$round.json" > "$out/new_$round.log" 2>&1
  "$old" "${args[@]}" --steps 16 --kfac-profile-out "$out/old_$round.json" > "$out/old_$round.log" 2>&1
  "$new" "${args[@]}" --steps 1 --kfac-profile "$out/old_$round.json" \
    > "$out/oldpred_$round.log" 2>&1
done
grep -H -E "PipeFisher: K-FAC|measured over" "$out"/*.log
