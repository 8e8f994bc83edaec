#!/usr/bin/env bash
# A rank killed mid-run (SIGKILL: no chance to report) must end the whole MPI job with an error
# well within the communication deadline, leaving no process behind.
#   kill_rank.sh <pipefisher_train> <mpirun and its options...>
set -uo pipefail
train=$1
shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/config.json" <<'JSON'
{"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
 "intermediate_size": 32, "max_position_embeddings": 32, "type_vocab_size": 2,
 "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "model_type": "bert"}
JSON
deadline_s=60
"$@" -np 2 "$train" --model "$work/config.json" --data synthetic --seq-len 12 \
  --micro-batch-size 2 --stages 2 --microbatches 4 --steps 1000000 --log-every 1 \
  --wait-timeout "$deadline_s" > "$work/log" 2>&1 &
job=$!
for _ in $(seq 1 600); do
  grep -q "step  *[0-9]" "$work/log" && break
  sleep 0.1
done
if ! grep -q "step  *[0-9]" "$work/log"; then
  echo "FAIL: training never started"; cat "$work/log"; kill -9 $(pgrep -P "$job") "$job"; exit 1
fi
# The ranks are mpirun's children; rank 1 is the one whose environment says so.
victim=""
for pid in $(pgrep -P "$job"); do
  if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then
    victim=$pid
  fi
done
ranks=$(pgrep -P "$job" | tr '\n' ' ')
if [[ -z "$victim" ]]; then
  echo "FAIL: no rank 1 among mpirun's children ($ranks)"; kill -9 $(pgrep -P "$job") "$job"; exit 1
fi
start=$(date +%s)
kill -9 "$victim"
# Wait for the job, but never longer than the deadline.
for _ in $(seq 1 $((deadline_s * 10))); do
  kill -0 "$job" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$job" 2>/dev/null; then
  echo "FAIL: the job still runs ${deadline_s} s after rank 1 was killed"
  kill -9 "$job" $ranks 2>/dev/null; exit 1
fi
wait "$job"
status=$?
elapsed=$(($(date +%s) - start))
tail -c 600 "$work/log"; echo
echo "job exited with status $status ${elapsed} s after rank 1 (pid $victim) was killed"
if [[ $status -eq 0 ]]; then echo "FAIL: the job reported success"; exit 1; fi
# mpirun has sent the other ranks SIGTERM; give them a few seconds to be gone.
alive() { [[ -e /proc/$1 ]] && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
for pid in $ranks; do
  for _ in $(seq 1 150); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    echo "FAIL: rank process $pid is still alive"; kill -9 "$pid"; exit 1
  fi
done
echo "PASS"
