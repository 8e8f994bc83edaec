#!/usr/bin/env bash
# The README's main job on an embedded default: pretrain a small BERT with PipeFisher — a 1F1B
# pipeline of 2 worker threads with K-FAC in its bubbles — on the demo corpus (built from Debian's
# Python documentation on first use), printing the loss as it falls, and writing a checkpoint,
# the metrics and the measured Chrome trace under out/.
#
#   scripts/demo.sh                  the training demo (a few minutes on 2 cores)
#   scripts/demo.sh --train FLAGS    pipefisher_train with your flags instead of the defaults
#   scripts/demo.sh --sim            the simulator demo: Chimera, BERT-Base, 4 stages on a
#                                    modelled H100, with K-FAC in the bubbles
#   scripts/demo.sh --sim FLAGS      pipefisher_sim with your flags
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh

mode=train
case "${1:-}" in
  --sim) mode=sim; shift ;;
  --train) shift ;;
esac

echo "demo: building (the first build takes a few minutes)..."
cmake -S . -B build/release -G Ninja "${PF_RELEASE_CONFIG[@]}" "${PF_LAUNCHER[@]}" >/dev/null
mkdir -p out

if [[ $mode == sim ]]; then
  cmake --build build/release -j "$PF_JOBS" --target pipefisher_sim >/dev/null
  if (($#)); then exec build/release/sim/cli/pipefisher_sim "$@"; fi
  exec build/release/sim/cli/pipefisher_sim --schedule chimera --stages 4 --microbatches 8 \
    --model base --device h100 --seq-len 128 --micro-batch-size 32 --kfac \
    --out out/schedule.json --trace out/trace.json --report out/report.json
fi

cmake --build build/release -j "$PF_JOBS" --target pipefisher_data pipefisher_train >/dev/null
if (($#)); then exec build/release/runtime/train/pipefisher_train "$@"; fi
if ! compgen -G "out/data/shards/*.pfshard" >/dev/null; then
  echo "demo: building the demo corpus, vocabulary and shards in out/data..."
  build/release/runtime/data/pipefisher_data demo --out-dir out/data --vocab-size 8192 \
    >out/data-report.json
fi
if [[ ! -d out/data/heldout && $(ls out/data/shards/*.pfshard | wc -l) -gt 1 ]]; then
  # The last shard (the corpus's last documents) is never trained on: the held-out set.
  mkdir -p out/data/heldout
  mv "$(ls out/data/shards/*.pfshard | sort | tail -n 1)" out/data/heldout/
fi
rm -rf out/checkpoints out/metrics.jsonl
# --kfac-max-refresh 10: the 40 steps see K-FAC refresh several times even where the measured
# capacity leaves the bubbles no room (two threads on cores that give about one core's worth:
# the pass would otherwise pick its cap of 64 steps, beyond the run).
exec build/release/runtime/train/pipefisher_train --model mini --data out/data/shards \
  --schedule 1f1b --stages 2 --microbatches 8 --micro-batch-size 8 --steps 40 --lr 1e-2 --kfac \
  --kfac-max-refresh 10 \
  --checkpoint-dir out/checkpoints --metrics out/metrics.jsonl --trace out/train_trace.json \
  --eval-data out/data/heldout --eval-every 10 --log-every 2
