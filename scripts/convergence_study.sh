#!/usr/bin/env bash
# Does PipeFisher pay off? The convergence study of docs/convergence.md: LAMB alone against K-FAC
# in the bubbles of the same 1F1B pipeline (p = 2, m = 8), same global batch and data order
# (the data order depends only on the seed), several seeds each, held-out loss measured every
# EVAL_EVERY steps. Runs pipefisher_train one run at a time (nice'd) and writes, per run,
# RESULTS/<run>/metrics.jsonl and RESULTS/<run>/log.txt; runs already finished are kept, so the
# study can be stopped and continued. Every run also writes RESULTS/<run>/profile.json (its
# measured durations, for pipefisher_sim --profile). The last phase, utilization, repeats seed 1
# of K-FAC at the pass's k for UTIL_STEPS steps with a Chrome trace, for the per-worker
# utilization figure. Draw the figures and table with scripts/convergence_plot.py.
#
#   scripts/convergence_study.sh [RESULTS]          (default out/convergence)
#   PHASES="lamb-sweep lamb-seeds lamb-warmup kfac kfac-warmup kfac-k1 kfac-sgd kfac-damping utilization" (default: all)
#   KFAC_WARMUP="16" (the kfac-warmup phase's --kfac-warmup-steps; several: "4 8 12")
#   LAMB_LR=5e-3 (skip the sweep's choice)  KFAC_K=8 (the k of phases run without the kfac phase)
#   MODEL=mini SEQ=128 STEPS=160 MBS=4 SEEDS="1 2 3" EVAL_EVERY=20 EVAL_BATCHES=16
#   LAMB_LRS="5e-3 1e-2 2e-2"  WARMUP=0.1  LAMB_WARMUPS="0.05 0.2"  DAMPINGS="1e-2" DAMPING_K=1  SGD_LRS=0.05
#
# The data: the demo corpus (pipefisher_data demo, vocabulary 8192, sequences of SEQ tokens with
# up to SEQ * 20 / 128 masked) with its last shard held out: DATA/shards trains, DATA/heldout
# evaluates (made on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-out/convergence}
build=${BUILD:-build/release}
seq=${SEQ:-128}
data=${DATA:-out/convergence-data-$seq}
model=${MODEL:-mini}
steps=${STEPS:-160}
mbs=${MBS:-4}
seeds=${SEEDS:-1 2 3}
eval_every=${EVAL_EVERY:-20}
eval_batches=${EVAL_BATCHES:-16}
lamb_lrs=${LAMB_LRS:-5e-3 1e-2 2e-2}
warmup=${WARMUP:-0.1}
phases=${PHASES:-lamb-sweep lamb-seeds lamb-warmup kfac kfac-warmup kfac-k1 kfac-sgd kfac-damping utilization}
train="$build/runtime/train/pipefisher_train"
mkdir -p "$results"

if [[ ! -d $data/heldout ]]; then
  echo "study: making the demo corpus in $data (last shard held out)"
  "$build/runtime/data/pipefisher_data" demo --out-dir "$data" --vocab-size 8192 \
    --max-seq-length "$seq" --max-predictions-per-seq $((seq * 20 / 128)) >"$data.report.json"
  mkdir -p "$data/heldout"
  last=$(ls "$data/shards"/*.pfshard | sort | tail -n 1)
  mv "$last" "$data/heldout/"
fi

# run NAME FLAGS...: one training run unless its results exist.
run() {
  local name=$1
  shift
  local dir="$results/$name"
  if [[ -f $dir/done ]]; then
    echo "study: $name (kept)"
    return
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  echo "study: $name: pipefisher_train $*"
  echo "pipefisher_train $*" >"$dir/command.txt"
  if ! nice -n 10 "$train" --model "$model" --data "$data/shards" --eval-data "$data/heldout" \
    --eval-every "$eval_every" --eval-batches "$eval_batches" --schedule 1f1b --stages 2 \
    --microbatches 8 --micro-batch-size "$mbs" --steps "${run_steps:-$steps}" --log-every 10 \
    --metrics "$dir/metrics.jsonl" --profile-out "$dir/profile.json" "$@" >"$dir/log.txt" 2>&1; then
    echo "study: $name FAILED: $(tail -n 1 "$dir/log.txt")"
    return 1
  fi
  date -u +%FT%TZ >"$dir/done"
  tail -n 3 "$dir/log.txt" | head -n 1
}

final_eval_loss() {  # the last held-out loss of a run
  python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1]) if "\"eval\"" in l]
print(r[-1]["eval_loss"])' "$results/$1/metrics.jsonl"
}

# LAMB's learning rate: the sweep's best final held-out loss (seed 1), or LAMB_LR when set (a
# phase run without the sweep's results, e.g. on another machine).
best_lamb_lr() {
  if [[ -n ${LAMB_LR:-} ]]; then
    echo "$LAMB_LR"
    return
  fi
  local best="" best_loss=""
  for lr in $lamb_lrs; do
    [[ -f $results/lamb-lr$lr-s1/done ]] || continue
    local loss
    loss=$(final_eval_loss "lamb-lr$lr-s1")
    if [[ -z $best ]] || python3 -c "import sys; sys.exit(0 if $loss < $best_loss else 1)"; then
      best=$lr best_loss=$loss
    fi
  done
  echo "${best:-1e-2}"
}

for phase in $phases; do
  case $phase in
    lamb-sweep)
      for lr in $lamb_lrs; do
        run "lamb-lr$lr-s1" --optimizer lamb --lr "$lr" --warmup "$warmup" --seed 1 || true
      done
      ;;
    lamb-seeds)
      lr=$(best_lamb_lr)
      for seed in $seeds; do
        run "lamb-lr$lr-s$seed" --optimizer lamb --lr "$lr" --warmup "$warmup" --seed "$seed" || true
      done
      ;;
    lamb-warmup)  # LAMB's warm-up fraction around the recipe's 10%, at the best learning rate
      lr=$(best_lamb_lr)
      for w in ${LAMB_WARMUPS:-0.05 0.2}; do
        run "lamb-lr$lr-w$w-s1" --optimizer lamb --lr "$lr" --warmup "$w" --seed 1 || true
      done
      ;;
    kfac)  # the PipeFisher pass's k, from seed 1's self-profile, then fixed for the other seeds;
      # when the pass finds no k whose K-FAC work fits in the bubbles, a fixed KFAC_K (the pass
      # then runs what does not fit after the flush)
      lr=$(best_lamb_lr)
      if run "kfac-lamb-lr$lr-s1" --optimizer lamb --lr "$lr" --warmup "$warmup" --seed 1 --kfac; then
        k=$(sed -n 's/^PipeFisher: K-FAC refresh every \([0-9]*\) step.*/\1/p' \
          "$results/kfac-lamb-lr$lr-s1/log.txt")
        for seed in $seeds; do
          [[ $seed == 1 ]] && continue
          run "kfac-lamb-lr$lr-s$seed" --optimizer lamb --lr "$lr" --warmup "$warmup" \
            --seed "$seed" --kfac --kfac-refresh "$k" || true
        done
      else
        k=${KFAC_K:-4}
        for seed in $seeds; do
          run "kfac$k-lamb-lr$lr-s$seed" --optimizer lamb --lr "$lr" --warmup "$warmup" \
            --seed "$seed" --kfac --kfac-refresh "$k" || true
        done
      fi
      ;;
    kfac-warmup)  # the pass's k (seed 1's, as the kfac phase) after KFAC_WARMUP steps of k = 1:
      # fresh curvature while the model changes fastest, then the bubbles' refresh interval
      lr=$(best_lamb_lr)
      k=$(sed -n 's/^PipeFisher: K-FAC refresh every \([0-9]*\) step.*/\1/p' \
        "$results/kfac-lamb-lr$lr-s1/log.txt" 2>/dev/null || true)
      k=${k:-${KFAC_K:-4}}
      for w in ${KFAC_WARMUP:-16}; do
        for seed in $seeds; do
          run "kfac$k-warmup$w-lamb-lr$lr-s$seed" --optimizer lamb --lr "$lr" --warmup "$warmup" \
            --seed "$seed" --kfac --kfac-refresh "$k" --kfac-warmup-steps "$w" || true
        done
      done
      ;;
    kfac-k1)  # fresh curvature every step: the upper bound on what staleness costs
      lr=$(best_lamb_lr)
      for seed in $seeds; do
        run "kfac1-lamb-lr$lr-s$seed" --optimizer lamb --lr "$lr" --warmup "$warmup" \
          --seed "$seed" --kfac --kfac-refresh 1 || true
      done
      ;;
    kfac-sgd)  # K-FAC's own first-order optimizer in PipeFisher: SGD with momentum
      for lr in ${SGD_LRS:-0.05}; do
        run "kfac-sgd-lr$lr-s1" --optimizer sgd --lr "$lr" --warmup "$warmup" --seed 1 --kfac \
          --kfac-refresh 1 || true
      done
      ;;
    kfac-damping)
      lr=$(best_lamb_lr)
      damping_k=${DAMPING_K:-1}  # the refresh interval of the damping runs
      for damping in ${DAMPINGS:-1e-2}; do
        run "kfac$damping_k-lamb-lr$lr-d$damping-s1" --optimizer lamb --lr "$lr" \
          --warmup "$warmup" --seed 1 --kfac --kfac-refresh "$damping_k" \
          --kfac-damping "$damping" || true
      done
      ;;
    utilization)  # seed 1 of the pass's k again, short, traced: utilization per worker
      lr=$(best_lamb_lr)
      k=$(sed -n 's/^PipeFisher: K-FAC refresh every \([0-9]*\) step.*/\1/p' \
        "$results/kfac-lamb-lr$lr-s1/log.txt" 2>/dev/null || true)
      k=${k:-${KFAC_K:-4}}
      run_steps=${UTIL_STEPS:-$((4 * k + 1))}
      run "utilization-kfac-lamb-lr$lr-k$k" --optimizer lamb --lr "$lr" --warmup "$warmup" \
        --seed 1 --kfac --kfac-refresh "$k" \
        --trace "$results/utilization-kfac-lamb-lr$lr-k$k/trace.json" || true
      run_steps=""
      ;;
    *)
      echo "study: unknown phase '$phase'" >&2
      exit 2
      ;;
  esac
done
echo "study: results in $results (draw them: python3 scripts/convergence_plot.py $results)"
