#!/usr/bin/env bash
# Collective checkpoints of pipefisher_train under mpirun: N steps straight through and k steps,
# save, resume to N give the same bits (every part file, every step's loss and gradient norm),
# with -np 2 and with -np 4 (data-parallel 2, shards, K-FAC sharded across the replicas, saved in
# the middle of a refresh); the MPI run matches the threaded one; a checkpoint of replicated
# state moves to another layout; sharded K-FAC state moves to another layout and placement at
# the end of a refresh window (= threads); a pipelined refresh running on into the next window
# is finished on its own schedule before another takes over (= threads); inside a refresh it
# moves dropping the refresh in progress (= threads); a corrupt part file is refused with one
# error line, every process exiting; K-FAC offload under mpirun resumes
# bit-identically and equals threads and the run without offload; a K-FAC warm-up under mpirun
# equals threads, and resumes inside its first main window.
#   checkpoint_resume.sh <pipefisher_train> <pipefisher_data> <mpirun and its options...>
set -uo pipefail
train=$(realpath "$1")
data_tool=$(realpath "$2")
shift 2
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1

fail() {
  echo "FAIL: $*"
  exit 1
}
# Runs a command that must succeed; its output is shown when it does not.
must() {
  if ! "$@" > log 2>&1; then
    cat log
    fail "this failed: $*"
  fi
}
# Losses and gradient norms of every step (times differ from run to run).
losses() { grep -o '"loss":[^,]*\|"grad_norm":[^,]*' "$1"; }
# Every file of two checkpoints' latest step, byte for byte.
same_checkpoints() {
  local a b
  a="$1/$(cat "$1/latest")"
  b="$2/$(cat "$2/latest")"
  [[ "$(basename "$a")" == "$(basename "$b")" ]] || fail "$a and $b are not the same step"
  [[ "$(ls "$a")" == "$(ls "$b")" ]] || fail "$a and $b hold other files: $(ls "$a") / $(ls "$b")"
  for file in "$a"/*; do
    cmp -s "$file" "$b/$(basename "$file")" || fail "$(basename "$file") differs: $a vs $b"
  done
}
# A job that must fail with exit status 2 and print `expected` exactly once.
refused() {
  local expected=$1
  shift
  local start status
  start=$(date +%s)
  timeout 120 "$@" > log 2>&1
  status=$?
  cat log
  [[ $status -ne 124 ]] || fail "the job hung"
  [[ $status -ne 0 ]] || fail "the job succeeded: $*"
  [[ "$(grep -c -- "$expected" log)" == 1 ]] || fail "expected one line with: $expected"
  echo "refused after $(($(date +%s) - start)) s, as expected"
}

cat > config.json << 'JSON'
{"vocab_size": 120, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
 "intermediate_size": 32, "max_position_embeddings": 32, "type_vocab_size": 2,
 "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "model_type": "bert"}
JSON
for i in $(seq 1 60); do
  echo "The cat number $i sat on the mat. A dog ran to the park with ball $((i % 7))."
  echo "Birds sing in tree $((i % 5)) every morning."
  echo
done > corpus.txt
must "$data_tool" vocab corpus.txt --out vocab.txt --size 120 --min-frequency 1
must "$data_tool" shards corpus.txt --vocab vocab.txt --out-dir shards --max-seq-length 16 \
  --max-predictions-per-seq 2 --dupe-factor 2 --format paragraphs

# -np 2: two pipeline stages, synthetic data, a save at step 3 of 6.
base=(--model config.json --data synthetic --seq-len 12 --micro-batch-size 2 --microbatches 4
  --quiet)
plain=("${base[@]}" --lr-decay-steps 6)
must "${mpirun[@]}" -np 2 "$train" "${plain[@]}" --stages 2 --steps 3 --checkpoint-dir a --metrics a.jsonl
must "${mpirun[@]}" -np 2 "$train" "${plain[@]}" --stages 2 --steps 6 --checkpoint-dir a --metrics a.jsonl \
  --resume
must "${mpirun[@]}" -np 2 "$train" "${plain[@]}" --stages 2 --steps 6 --checkpoint-dir b --metrics b.jsonl
same_checkpoints a b
[[ "$(losses a.jsonl)" == "$(losses b.jsonl)" ]] || fail "-np 2: the losses differ"
[[ "$(losses a.jsonl | wc -l)" == 12 ]] || fail "-np 2: not 6 steps of metrics"
echo "-np 2: resumed run bit-identical to the straight one"

# Replicated state moves to another layout: the step-3 checkpoint continues on 4 stages.
mkdir c && cp -r a/step-00000003 c/ && echo step-00000003 > c/latest
must "${mpirun[@]}" -np 4 "$train" "${plain[@]}" --stages 4 --steps 6 --checkpoint-dir c --resume
[[ "$(cat c/latest)" == step-00000006 ]] || fail "the resume on 4 stages saved no step 6"
echo "-np 2 checkpoint resumed on -np 4 (4 stages)"

# -np 4: two stages x two data-parallel replicas, shards, K-FAC sharded over the replicas with a
# two-step refresh, saved at step 3 (inside a refresh). One measured profile places K-FAC alike
# in every run.
kfac=(--model config.json --data shards --micro-batch-size 2 --microbatches 4 --data-parallel 2 --lr-decay-steps 6 --quiet --kfac --kfac-refresh 2 --kfac-sharding shard)
must "$train" "${kfac[@]}" --stages 2 --steps 2 --profile-out profile.json
kfac+=(--kfac-profile profile.json)
must "${mpirun[@]}" -np 4 "$train" "${kfac[@]}" --stages 2 --steps 3 --checkpoint-dir k --metrics k.jsonl
must "${mpirun[@]}" -np 4 "$train" "${kfac[@]}" --stages 2 --steps 6 --checkpoint-dir k --metrics k.jsonl \
  --resume
must "${mpirun[@]}" -np 4 "$train" "${kfac[@]}" --stages 2 --steps 6 --checkpoint-dir l --metrics l.jsonl
same_checkpoints k l
[[ "$(losses k.jsonl)" == "$(losses l.jsonl)" ]] || fail "-np 4: the losses differ"
ls k/step-00000006/kfac-0000[1-4]-of-00004.safetensors > /dev/null ||
  fail "-np 4: not every rank wrote its K-FAC state"
grep -q '"placement": "shard"' k/step-00000003/state.json || fail "no placement in state.json"
# Threads, same configuration: the same numbers.
must "$train" "${kfac[@]}" --stages 2 --steps 6 --metrics threads.jsonl
[[ "$(losses threads.jsonl)" == "$(losses l.jsonl)" ]] || fail "threads and MPI differ"
echo "-np 4: resumed run bit-identical to the straight one and to threads"

# The same with the sharded K-FAC state offloaded to host memory (each rank moves what it holds;
# the PipeFisher pass places K-FAC from the same profile, the host link measured once in rank 0):
# saved inside a refresh and resumed, the losses equal the run without offload's.
sharded_offload=("${kfac[@]}" --kfac-offload host)
must "${mpirun[@]}" -np 4 "$train" "${sharded_offload[@]}" --stages 2 --steps 3 --checkpoint-dir so \
  --metrics so.jsonl
must "${mpirun[@]}" -np 4 "$train" "${sharded_offload[@]}" --stages 2 --steps 6 --checkpoint-dir so \
  --metrics so.jsonl --resume
[[ "$(losses so.jsonl)" == "$(losses l.jsonl)" ]] ||
  fail "-np 4: sharded state with offload, resumed, differs from the run without offload"
echo "-np 4 with sharded K-FAC state offloaded: resumed = without offload"

# K-FAC offload to host memory under mpirun (-np 2, two stages), placed from one profile (it
# carries the host link, so every run places the same copies): saved inside a refresh and
# resumed equals straight, byte for byte, and the losses equal the threaded run's and the run
# without offload's (the copies are exact).
kept=("${base[@]}" --lr-decay-steps 6 --kfac --kfac-refresh 2)
offload=("${kept[@]}" --kfac-offload host)
must "$train" "${offload[@]}" --stages 2 --steps 2 --profile-out offload_profile.json
kept+=(--kfac-profile offload_profile.json)
offload+=(--kfac-profile offload_profile.json)
must "${mpirun[@]}" -np 2 "$train" "${offload[@]}" --stages 2 --steps 3 --checkpoint-dir o \
  --metrics o.jsonl
must "${mpirun[@]}" -np 2 "$train" "${offload[@]}" --stages 2 --steps 6 --checkpoint-dir o \
  --metrics o.jsonl --resume
must "${mpirun[@]}" -np 2 "$train" "${offload[@]}" --stages 2 --steps 6 --checkpoint-dir p \
  --metrics p.jsonl
same_checkpoints o p
[[ "$(losses o.jsonl)" == "$(losses p.jsonl)" ]] || fail "offload: the resumed losses differ"
must "$train" "${offload[@]}" --stages 2 --steps 6 --metrics offload_threads.jsonl
[[ "$(losses offload_threads.jsonl)" == "$(losses p.jsonl)" ]] ||
  fail "offload: threads and MPI differ"
must "${mpirun[@]}" -np 2 "$train" "${kept[@]}" --stages 2 --steps 6 --metrics kept.jsonl
[[ "$(losses kept.jsonl)" == "$(losses p.jsonl)" ]] || fail "offload: with and without differ"
echo "-np 2 with K-FAC offload: resumed = straight = threads = without offload"

# A K-FAC warm-up under mpirun (its state moved in memory, each process its own ranks), three
# steps of a refresh every step, then windows of 2 from step 3: two stages x two replicas (-np 4,
# shards; K-FAC state replicated and sharded) and Chimera (-np 2) equal the threaded runs loss
# for loss; a checkpoint saved inside the first main window (step 4) resumes to the straight
# run's losses.
warm=(--model config.json --data shards --micro-batch-size 2 --microbatches 4 --lr-decay-steps 6
  --quiet --kfac --kfac-refresh 2)
for layout in "dp --data-parallel 2 --stages 2" "chimera --schedule chimera --stages 2" \
  "shard --data-parallel 2 --stages 2 --kfac-sharding shard"; do
  read -r name flags <<< "$layout"
  read -ra flags <<< "$flags"
  must "$train" "${warm[@]}" "${flags[@]}" --steps 2 --profile-out "warm_$name.json"
  run=("${warm[@]}" "${flags[@]}" --kfac-profile "warm_$name.json" --steps 6)
  np=$([[ $name == chimera ]] && echo 2 || echo 4)
  must "${mpirun[@]}" -np "$np" "$train" "${run[@]}" --kfac-warmup-steps 3 --metrics "wm_$name.jsonl" \
    --checkpoint-dir "wm_$name" --checkpoint-every 2
  must "$train" "${run[@]}" --kfac-warmup-steps 3 --metrics "wt_$name.jsonl"
  [[ "$(losses "wm_$name.jsonl" | wc -l)" == 12 ]] || fail "warm-up $name: not 6 steps of metrics"
  [[ "$(losses "wm_$name.jsonl")" == "$(losses "wt_$name.jsonl")" ]] ||
    fail "warm-up $name: threads and MPI differ"
  grep -q '"window_origin": 3' "wm_$name/step-00000004/state.json" ||
    fail "warm-up $name: no window origin 3 in the step-4 checkpoint"
  rm -rf "wm_$name/step-00000006" && echo step-00000004 > "wm_$name/latest"
  must "${mpirun[@]}" -np "$np" "$train" "${run[@]}" --checkpoint-dir "wm_$name" --resume \
    --metrics "wr_$name.jsonl"
  [[ "$(losses "wr_$name.jsonl")" == "$(losses "wm_$name.jsonl" | tail -n 4)" ]] ||
    fail "warm-up $name: resumed inside the first main window, the losses differ"
  echo "warm-up under mpirun ($name, -np $np) = threads; resumed inside a window = straight"
done

# Sharded K-FAC state moves to another layout and placement at the end of a refresh window (each
# Linear's state from the ranks that owned it): saved at step 4 on -np 4, resumed on one stage
# (-np 2) replicated and sharded, the same losses as the threaded resumes.
must "${mpirun[@]}" -np 4 "$train" "${kfac[@]}" --stages 2 --steps 4 --checkpoint-dir r
moved=()  # the same flags without --kfac-sharding
for ((i = 0; i < ${#kfac[@]}; ++i)); do
  if [[ ${kfac[i]} == --kfac-sharding ]]; then ((++i)); else moved+=("${kfac[i]}"); fi
done
for sharding in replicate shard; do
  for how in mpi threads; do
    rm -rf "r_$how" && mkdir "r_$how" && cp -r r/step-00000004 "r_$how/" &&
      echo step-00000004 > "r_$how/latest"
    launcher=()
    [[ $how == mpi ]] && launcher=("${mpirun[@]}" -np 2)
    must "${launcher[@]}" "$train" "${moved[@]}" --kfac-sharding "$sharding" --stages 1 --steps 6 \
      --checkpoint-dir "r_$how" --resume --metrics "r_${how}_$sharding.jsonl"
  done
  [[ "$(losses "r_mpi_$sharding.jsonl" | wc -l)" == 4 ]] || fail "re-sharded: not 2 steps of metrics"
  [[ "$(losses "r_mpi_$sharding.jsonl")" == "$(losses "r_threads_$sharding.jsonl")" ]] ||
    fail "sharded state moved to one stage, $sharding: threads and MPI differ"
done
echo "-np 4 sharded K-FAC state at a window's end resumed on -np 2 (one stage), replicated and sharded = threads"

# A pipelined refresh whose inversions run on into the next window (fixed times in the profile
# place some there), saved at a window's end on -np 2, resumes on another schedule
# (--kfac-replan --kfac-refresh 3): its own schedule finishes the refresh first, through a
# checkpoint on disk beside the run's (gone afterwards); the losses equal the threaded resume's.
must "$train" "${base[@]}" --lr-decay-steps 8 --stages 2 --steps 2 --kfac --profile-out pipelined_profile.json
python3 - pipelined_profile.json << 'PY'
import json, sys
path = sys.argv[1]
profile = json.load(open(path))
for chunk in profile["chunks"]:
    chunk["forward_s"], chunk["backward_s"] = 1e-4, 2e-4
profile["communication"]["bandwidth"] = profile["reduction"]["bandwidth"] = 1e8
profile["optimizer_step_s"] = 7e-5
for entry in profile["kfac"]:  # (a self-profile's K-FAC tasks vary from run to run)
    entry["curvature_a_s"] = entry["curvature_b_s"] = 3e-6
    entry["precondition_s"] = 1e-6
    entry["invert_a_s"] = entry["invert_b_s"] = 3e-5
    entry["bytes"] = 4096.0
json.dump(profile, open(path, "w"))
PY
pipelined=("${base[@]}" --lr-decay-steps 8 --stages 2 --kfac --kfac-pipelined-refresh on
  --kfac-split off --kfac-profile pipelined_profile.json)
must "${mpirun[@]}" -np 2 "$train" "${pipelined[@]}" --steps 4 --kfac-refresh 2 --checkpoint-dir pr \
  --checkpoint-every 2
python3 -c '
import json, sys
schedule = json.load(open("pr/step-00000004/schedule.json"))
sys.exit(0 if any(i.get("step", 0) < 0 for s in schedule["streams"] for i in s) else 1)' ||
  fail "no inversion placed in the next window: this check needs one"
for how in mpi threads; do
  rm -rf "pr_$how" && cp -r pr "pr_$how"
  launcher=()
  [[ $how == mpi ]] && launcher=("${mpirun[@]}" -np 2)
  must "${launcher[@]}" "$train" "${pipelined[@]}" --steps 8 --kfac-refresh 3 --kfac-replan \
    --checkpoint-dir "pr_$how" --resume --metrics "pr_$how.jsonl"
  [[ ! -e "pr_$how/.refresh-finished" ]] || fail "the finishing checkpoint was left in pr_$how"
done
[[ "$(losses pr_mpi.jsonl | wc -l)" == 8 ]] || fail "pipelined, finished: not 4 steps of metrics"
[[ "$(losses pr_mpi.jsonl)" == "$(losses pr_threads.jsonl)" ]] ||
  fail "pipelined refresh finished before another schedule: threads and MPI differ"
echo "-np 2 pipelined refresh running on, finished and moved to another schedule = threads"

# Inside a refresh (step 3 of a two-step refresh) it moves too, dropping the refresh in
# progress: on one stage (-np 2), the threaded resume's losses.
mkdir m && cp -r k/step-00000003 m/ && echo step-00000003 > m/latest
for how in mpi threads; do
  rm -rf "m_$how" && cp -r m "m_$how"
  launcher=()
  [[ $how == mpi ]] && launcher=("${mpirun[@]}" -np 2)
  must "${launcher[@]}" "$train" "${kfac[@]}" --stages 1 --steps 6 --checkpoint-dir "m_$how" \
    --resume --metrics "m_$how.jsonl"
done
[[ "$(losses m_mpi.jsonl | wc -l)" == 6 ]] || fail "moved inside a refresh: not 3 steps of metrics"
[[ "$(losses m_mpi.jsonl)" == "$(losses m_threads.jsonl)" ]] ||
  fail "sharded state moved inside a refresh: threads and MPI differ"
echo "-np 4 sharded K-FAC state inside a refresh resumed on -np 2 (one stage), the refresh dropped = threads"

# A corrupt part: one line naming it, every process exits.
printf 'X' | dd of=m/step-00000003/kfac-00003-of-00004.safetensors bs=1 seek=100 conv=notrunc \
  2> /dev/null
refused "kfac-00003-of-00004.safetensors is corrupt" \
  "${mpirun[@]}" -np 4 "$train" "${kfac[@]}" --stages 2 --steps 6 --checkpoint-dir m --resume
# A rank killed while the job saves every step (SIGKILL at some moment of a save or a step):
# `latest` still names a whole checkpoint, and the run resumes from it.
"${mpirun[@]}" -np 2 "$train" "${base[@]}" --stages 2 --steps 1000000 --lr-decay-steps 1000000 \
  --checkpoint-dir killed --checkpoint-every 1 --wait-timeout 30 > killed.log 2>&1 &
job=$!
for _ in $(seq 1 600); do
  [[ -f killed/latest && "$(cat killed/latest)" != step-00000001 ]] && break
  sleep 0.1
done
sleep "0.$((RANDOM % 10))"
victim=""
for pid in $(pgrep -P "$job"); do
  if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then
    victim=$pid
  fi
done
[[ -n "$victim" ]] || { kill -9 $(pgrep -P "$job") "$job"; fail "no rank 1 to kill"; }
kill -9 "$victim"
wait "$job" && fail "the job survived the loss of a rank"
saved=$(cat killed/latest)
step=$((10#${saved#step-}))
must "${mpirun[@]}" -np 2 "$train" "${base[@]}" --stages 2 --steps $((step + 2)) \
  --lr-decay-steps 1000000 --checkpoint-dir killed --resume
[[ "$(cat killed/latest)" == "$(printf 'step-%08d' $((step + 2)))" ]] ||
  fail "the resume from $saved did not reach step $((step + 2))"
echo "killed during saves at $saved: resumed from it"
echo "PASS"
