#!/usr/bin/env bash
# Fits this machine's CPU device to training runs and checks it on a run it was not fitted on
# (docs/simulator.md, "A pipefisher_train step from the analytic model alone"):
#   1. pipefisher_train runs BERT-mini (vocabulary 8192, sequence 128, 8 micro-batches, LAMB,
#      synthetic data, one thread per worker) at micro-batch 4, 8 and 16, on one worker (GPipe)
#      and on two (1F1B), each writing its mean durations as calibration records
#      (--calibration-out);
#   2. pipefisher_sim calibrate fits one device to the one-worker records and one to the
#      two-worker records (a worker's share of the machine while the other computes), holding
#      micro-batch 8 out, from a device fitted to this CPU's kernels timed alone
#      (bench_sim_calibrate, about a minute): 14 parameters and 18 records of one worker leave
#      the fit underdetermined, so where it starts is its prior, and the kernels' device knows
#      this CPU's rates and its cache cliffs where nominal peaks do not;
#   3. pipefisher_sim predicts the micro-batch-8 steps from the analytic model with each device,
#      beside the measured step times.
# Usage: scripts/calibrate_from_training.sh [OUT_DIR] (default out/calibrate-from-training)
# Env: BUILD (default build/release), STEPS (default 6), SIZES (default "4 8 16"), HOLD_OUT (8),
# REPEATS (rounds of every run, default 3; about 2.5 minutes each on a 2-core machine), START (the
# device to fit from; default: the kernels' device, fitted from this-cpu, one core of this CPU
# with its peaks from its measured clock and vector width and its caches, sim/cpu_device.h;
# START=this-cpu fits from that core's nominal peaks directly. The fit cannot pass the start's
# peaks: the AVX2 core of sim/calibration/cpu_start.json held an AVX-512 Xeon's devices 20-35%
# slow).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build/release}
out=${1:-out/calibrate-from-training}
steps=${STEPS:-6}
sizes=${SIZES:-4 8 16}
hold_out=${HOLD_OUT:-8}
repeats=${REPEATS:-3}
start=${START:-}
train="$build/runtime/train/pipefisher_train"
sim="$build/sim/cli/pipefisher_sim"
kernels="$build/bench/bench_sim_calibrate"
programs=("$train" "$sim")
[[ -n $start ]] || programs+=("$kernels")
for program in "${programs[@]}"; do
  [[ -x "$program" ]] || { echo "error: $program is not built (cmake --build $build)" >&2; exit 2; }
done
mkdir -p "$out"
if [[ -z $start ]]; then
  # This CPU's kernels timed alone, fitted from this-cpu on half their shapes (the other half
  # reported), before the training runs so that both see the machine in the same hour.
  "$kernels" --threads 1 --repeats 31 --max-order 3072 --out "$out/kernels.json" 2> /dev/null
  "$sim" calibrate --measurements "$out/kernels.json" --device this-cpu --hold-out shape_set=b \
    --out "$out/kernels_device.json" --name this-cpu-kernels > "$out/fit_kernels.txt"
  echo "kernels' device: $(sed -n 's/^fitted \(.*\)/\1/p' "$out/fit_kernels.txt")"
  start="$out/kernels_device.json"
fi
config="$out/mini8192.json"
cat > "$config" << 'JSON'
{"vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
 "intermediate_size": 1024, "max_position_embeddings": 512, "type_vocab_size": 2,
 "model_type": "bert"}
JSON

# Rounds of every run, interleaved, so that a slow minute of a shared machine does not land on
# one size only: the fit takes every round's records, a step time is the median over rounds.
declare -A measured
for round in $(seq 1 "$repeats"); do
  for size in $sizes; do
    for workers in 1 2; do
      schedule=$([[ $workers == 1 ]] && echo gpipe || echo 1f1b)
      run="p${workers}_mb${size}"
      "$train" --model "$config" --data synthetic --seq-len 128 --micro-batch-size "$size" \
        --microbatches 8 --stages "$workers" --schedule "$schedule" --steps "$steps" --quiet \
        --calibration-out "$out/$run.r$round.json" > "$out/$run.r$round.log" 2>&1 ||
        { cat "$out/$run.r$round.log"; echo "error: the $run run failed" >&2; exit 1; }
      step=$(sed -n 's/^measured over steps [0-9-]*: \([0-9.]*\) s\/step.*/\1/p' \
        "$out/$run.r$round.log")
      measured[$run]="${measured[$run]:-} $step"
      echo "round $round, $run: measured $step s/step"
    done
  done
done
median() { tr ' ' '\n' <<< "$1" | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

# A step's records are sums over hundreds of kernels, and the optimizer step has one size per
# worker count: they cannot place a cache cliff. Fitted freely, the two-worker device of run set F
# put a 990x cliff between its optimizer's 107 MB and the one worker's 155 MB (the one-worker
# optimizer step predicted 11x too long). So the memory class keeps the start device's shape
# (the kernels' device: its two cliffs fitted to adds of 100 KB ... 100 MB; this-cpu: the cliffs
# at the caches with no slowdown, one bandwidth for every size) and the fit sets its efficiencies
# only.
keep_cache_shape=(--keep classes.memory.half_efficiency_size --keep classes.memory.beyond_cache_slowdown
  --keep classes.memory.size_exponent --keep classes.memory.roofline_exponent
  --keep classes.memory.outer_cache_bytes --keep classes.memory.beyond_outer_cache_slowdown)

# One measurements file per worker count, every record tagged with its run and round.
start_device="$out/start_device.json"
rm -f "$start_device"
for workers in 1 2; do
  files=()
  for size in $sizes; do files+=("$out/p${workers}_mb${size}".r*.json); done
  python3 - "$out/records_p$workers.json" "${files[@]}" << 'PY'
import json, os, sys
records = []
for path in sys.argv[2:]:
    run, round_ = os.path.basename(path)[:-5].split(".")
    for record in json.load(open(path))["measurements"]:
        record["run"], record["round"] = run, round_
        records.append(record)
json.dump({"format_version": 1, "description": "pipefisher_train --calibration-out records",
           "measurements": records}, open(sys.argv[1], "w"), indent=1)
PY
  # The start device once, for both fits (this-cpu measures the clock each time it is named).
  if [[ ! -f $start_device ]]; then
    "$sim" calibrate --measurements "$out/records_p$workers.json" --device "$start" --no-fit \
      --out "$start_device" > /dev/null
    echo "start device: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["name"])' "$start_device")"
  fi
  "$sim" calibrate --measurements "$out/records_p$workers.json" \
    --device "$start_device" --hold-out "micro_batch_size=$hold_out" \
    "${keep_cache_shape[@]}" --out "$out/device_p$workers.json" --name "cpu-$workers-worker-training" \
    > "$out/fit_p$workers.txt"
  echo "device fitted to the $workers-worker runs (micro-batch $hold_out held out):"
  sed -n '/^operation/,$p' "$out/fit_p$workers.txt"
done

echo
echo "micro-batch $hold_out steps from the analytic model alone:"
printf '%-28s %10s %16s %16s\n' run "measured (median)" "1-worker device" "2-worker device"
for workers in 1 2; do
  schedule=$([[ $workers == 1 ]] && echo gpipe || echo 1f1b)
  run="p${workers}_mb${hold_out}"
  step=$(median "${measured[$run]}")
  row=$(printf '%-28s %10s' "$run ($schedule, p = $workers)" "$step")
  for device in 1 2; do
    predicted=$("$sim" --schedule "$schedule" -p "$workers" -m 8 --layers 4 --model "$config" \
      --micro-batch-size "$hold_out" --seq-len 128 --precision fp32 \
      --device "$out/device_p$device.json" --grid none |
      sed -n 's/^step time \([0-9.]*\) s.*/\1/p')
    error=$(python3 -c "print(f'{100 * ($predicted / $step - 1):+.1f}%')")
    row+=$(printf ' %16s' "$predicted ($error)")
  done
  echo "$row"
done
