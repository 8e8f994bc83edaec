#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one call (or in parts, to stay under the
# device tool's per-call limit), logs under $OUT:
#   build  scripts/gpu_check.sh's build of the CUDA targets, plus the device-path tests and
#          pipefisher_train (build/gpu)
#   test   every CUDA test (kernels, K-FAC, optimizers, model, executor on one GPU) and the
#          device-path tests that also run on the CPU
#   bench  the CUDA benchmarks (GEMM, attention, LayerNorm, BERT-Large layer and stage in
#          fp32/TF32/BF16, K-FAC, optimizers) and the PyTorch baseline bench/torch_cuda_bench.py
#          (the same ops; the BERT-Large layer forward+backward under bf16 autocast)
#   train  pipefisher_train --device cuda end to end: one worker and p = 4 pipeline workers on
#          the GPU (measured trace and profile from CUDA events), fp32 against the CPU on the
#          same seed, K-FAC in the bubbles, and the no-device error path (exit 2)
#   scripts/gpu_session.sh [build|test|bench|train|all]...   (default: all)
# Exit status 1 when a step failed; every step still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/pf_gpu}
mkdir -p "$OUT"
parts=("${@:-all}")
want() { [[ " ${parts[*]} " == *" all "* || " ${parts[*]} " == *" $1 "* ]]; }
status=0
note() { echo "== $*" | tee -a "$OUT/session.log"; }
export PF_GPU_EXTRA_TARGETS="test_executor_cuda test_executor_device test_device pipefisher_train"

if want build; then
  note "build (log: build.log)"
  scripts/gpu_check.sh build 2>&1 | tee -a "$OUT/session.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
bin=build/gpu/runtime/train/pipefisher_train

if want test; then
  note "CUDA tests and device-path tests (log: tests.log)"
  scripts/gpu_check.sh test 2>&1 | tee -a "$OUT/session.log" || status=1
  for t in build/gpu/tests/executor/test_executor_device build/gpu/tests/device/test_device; do
    echo "== $t" | tee -a "$OUT/tests.log"
    "$t" 2>&1 | tee -a "$OUT/tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi

if want bench; then
  note "CUDA benchmarks and the PyTorch baseline (logs: bench.log, torch.log)"
  scripts/gpu_check.sh bench torch 2>&1 | tail -n 200 >>"$OUT/session.log" || status=1
fi

train() {  # train NAME ARGS...: one pipefisher_train run, its log, its exit status
  local name=$1
  shift
  echo "\$ pipefisher_train $*" >"$OUT/train_$name.log"
  "$bin" "$@" >>"$OUT/train_$name.log" 2>&1
  local rc=$?
  note "train $name: exit $rc (log: train_$name.log)"
  tail -n 4 "$OUT/train_$name.log" | tee -a "$OUT/session.log"
  return $rc
}

if want train; then
  if [[ ! -x $bin ]]; then
    note "train: $bin is not built (run the build part)"
    status=1
  else
    common=(--data synthetic --seq-len 128 --seed 1 --log-every 5)
    # BERT-Large, micro-batch 8, one worker then 4 pipeline workers (1F1B) on the one GPU.
    train large_single "${common[@]}" --model large --device cuda --precision bf16 \
      --schedule 1f1b --stages 1 --microbatches 4 --micro-batch-size 8 --steps 10 \
      --trace "$OUT/trace_large_single.json" --profile-out "$OUT/profile_large_single.json" ||
      status=1
    train large_1f1b_p4 "${common[@]}" --model large --device cuda --precision bf16 \
      --schedule 1f1b --stages 4 --microbatches 8 --micro-batch-size 8 --steps 10 \
      --trace "$OUT/trace_large_p4.json" --profile-out "$OUT/profile_large_p4.json" || status=1
    # fp32 on the GPU against the CPU, same seed and schedule: the per-step losses side by side.
    small=("${common[@]}" --model mini --schedule 1f1b --stages 2 --microbatches 4
      --micro-batch-size 4 --optimizer sgd)
    rm -f "$OUT/metrics_gpu_fp32.jsonl" "$OUT/metrics_cpu_fp32.jsonl"
    train mini_gpu_fp32 "${small[@]}" --steps 6 --device cuda --precision fp32 \
      --metrics "$OUT/metrics_gpu_fp32.jsonl" || status=1
    train mini_cpu_fp32 "${small[@]}" --steps 6 --device cpu --precision fp32 \
      --metrics "$OUT/metrics_cpu_fp32.jsonl" || status=1
    python3 - "$OUT/metrics_cpu_fp32.jsonl" "$OUT/metrics_gpu_fp32.jsonl" <<'PY' | tee -a "$OUT/session.log"
import json, sys
rows = [[json.loads(l) for l in open(p) if '"loss"' in l] for p in sys.argv[1:]]
print("step  cpu loss    gpu loss    rel diff")
for c, g in zip(*rows):
    print(f"{c['step']:4d}  {c['loss']:.6f}  {g['loss']:.6f}  {abs(g['loss'] - c['loss']) / c['loss']:.2e}")
PY
    # K-FAC in the bubbles on the GPU, placed by the pass from the GPU's self-profile (the
    # schedule and the K-FAC kernels timed on the device); then BERT-Large, bf16, 1F1B p = 4.
    train mini_gpu_kfac "${small[@]}" --device cuda --precision fp32 --kfac --steps 8 \
      --trace "$OUT/trace_mini_kfac.json" || status=1
    train large_1f1b_p4_kfac "${common[@]}" --model large --device cuda --precision bf16 \
      --schedule 1f1b --stages 4 --microbatches 8 --micro-batch-size 8 --steps 10 --kfac \
      --trace "$OUT/trace_large_p4_kfac.json" --profile-out "$OUT/profile_large_p4_kfac.json" ||
      status=1
    # No device visible: one error line, exit 2.
    CUDA_VISIBLE_DEVICES="" "$bin" --data synthetic --device cuda --steps 1 \
      >"$OUT/train_no_device.log" 2>&1
    rc=$?
    note "train no_device: exit $rc (expected 2): $(head -c 300 "$OUT/train_no_device.log")"
    [[ $rc -eq 2 ]] || status=1
  fi
fi
note "done, status $status"
exit $status
