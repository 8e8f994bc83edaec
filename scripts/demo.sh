#!/usr/bin/env bash
# The README's main job on an embedded default: compile a pipeline schedule, fill its bubbles
# with K-FAC work (PipeFisher), simulate it on a modelled GPU and write the Chrome trace.
# Any arguments are passed on to pipefisher_sim and replace the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh

cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${PF_LAUNCHER[@]}" >/dev/null
cmake --build build/release -j "$PF_JOBS" --target pipefisher_sim
mkdir -p out
if (($#)); then
  exec build/release/sim/cli/pipefisher_sim "$@"
fi
exec build/release/sim/cli/pipefisher_sim --schedule chimera --stages 4 --microbatches 8 \
  --model base --device h100 --seq-len 128 --micro-batch-size 32 --kfac \
  --out out/schedule.json --trace out/trace.json --report out/report.json
