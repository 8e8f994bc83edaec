#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one call (or in parts, to stay under the
# device tool's per-call limit), logs under $OUT:
#   build  scripts/gpu_check.sh's build of the CUDA targets, plus the device-path tests and
#          pipefisher_train (build/gpu)
#   test   every CUDA test (kernels, K-FAC, optimizers, model, executor on one GPU) and the
#          device-path tests that also run on the CPU
#   bf16   the bf16-operands experiment alone (docs/cuda.md, "bf16 operands"; ~2 min): its
#          CUDA tests, then its GEMMs and the BERT-Large stage against bf16 and TF32 (limit
#          PF_BF16_BENCH_TIMEOUT, default 120 s a program; figures in bench.log and session.log)
#   attention  the fused (flash-style) attention against the batched GEMMs (docs/cuda.md,
#          "attention: fused vs batched"; ~1 min): its CUDA tests, then BM_AttentionForwardBackward
#          (both algorithms at 32 x 128 and 8 x 512, fp32/TF32/bf16/bf16-operands) and the
#          BERT-Large layer in TF32 and bf16 with each (3 repetitions unless PF_BENCH_REPS; limit
#          PF_ATTENTION_BENCH_TIMEOUT, default 120 s); alone (not under bench) also
#          pipefisher_train --attention batched|fused: BERT-Large bf16 one worker, and BERT-mini
#          fp32 losses side by side
#   bench  first the bf16 and attention parts' work (once, also under all), then the CUDA benchmarks
#          (GEMM, attention, LayerNorm, BERT-Large layer and stage in fp32/TF32/BF16/
#          bf16-operands, K-FAC, optimizers) and the PyTorch baseline bench/torch_cuda_bench.py
#          (the same ops; the BERT-Large layer forward+backward under bf16 autocast)
#   train  pipefisher_train --device cuda end to end: one worker and p = 4 pipeline workers on
#          the GPU (measured trace and profile from CUDA events), fp32 against the CPU on the
#          same seed, K-FAC in the bubbles with held-out evaluation, the pipelined refresh, a
#          checkpoint resume against the straight run, and the no-device error path (exit 2)
#   nccl   the NCCL communicator under mpirun (log: nccl.log): one rank on the GPU (world of one,
#          send/receive to itself, all-reduce of one rank, broadcast, event ordering with a
#          compute stream, the watchdog's abort of a stuck receive); bench_nccl -np 1 (our
#          communicator against raw NCCL calls: creation, all-reduce, broadcast, grouped
#          send/recv to itself, host staging, bytes to 256 MiB, every result verified; ~10 s,
#          appended to nccl.log, its summary lines in session.log); then the question whether
#          this NCCL runs 2 ranks on one GPU (PF_NCCL_SHARE_GPU=1 mpirun -np 2: "Duplicate GPU
#          detected" or success, and if it runs, the 2-rank tests); pipefisher_train --device
#          cuda under mpirun -np 1 (NCCL path) against the threaded run, and -np 2 on one GPU
#          (one error line, exit 2)
#   offload K-FAC offload against none on BERT-Large bf16 from one profile: losses side by side
#   calib  what the simulator's calibration needs (issue #19; docs/simulator.md, "This project's
#          runtime on an H200"), under $OUT/calib and packed into $OUT/calib.tar.gz (one file
#          back): pipefisher_train --calibration-out of BERT-Large bf16 one worker at micro-batch
#          32 (beside the train part's micro-batch 8, whose records land there too, as do the
#          p = 4 runs' with and without K-FAC), TF32 one worker at 8, and 1F1B p = 2 at 8; the
#          bf16 GEMMs (bench_cuda BM_Gemm) unless the bench part's log has them; the kernels
#          one class at a time (bench_device_kernels) and one worker at micro-batch 1, 2, 4 and
#          16; every record merged into calib/measurements.json by scripts/gpu_calibration.py
#          records. About 2 min on the H200 (BERT-Large runs of 4 steps, ~8 s each to build the
#          model; the kernels ~30 s). Fit
#          and check on the development machine:
#            tar xzf calib.tar.gz && scripts/gpu_calibration.py fit calib/measurements.json \
#              --out-dir out/h200-fit
#   scripts/gpu_session.sh [build|test|bf16|attention|bench|train|offload|nccl|calib|all]...
#   (default: all)
# Exit status 1 when a step failed; every step still runs. A lease is short: PF_GPU_DEADLINE
# (seconds since the epoch) skips the training runs that would start after it, and each run is
# stopped after PF_GPU_RUN_TIMEOUT seconds (default 150) or at the deadline, whichever is first.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/pf_gpu}
mkdir -p "$OUT"
parts=("${@:-all}")
want() { [[ " ${parts[*]} " == *" all "* || " ${parts[*]} " == *" $1 "* ]]; }
status=0
note() { echo "== $*" | tee -a "$OUT/session.log"; }
# compare_losses NAME_A NAME_B METRICS_A METRICS_B: the per-step losses of two runs side by side
# (and in session.log), with their relative difference.
compare_losses() {
  python3 - "$@" <<'PY' | tee -a "$OUT/session.log"
import json, os, sys
name_a, name_b, *paths = sys.argv[1:]
if not all(os.path.exists(p) for p in paths):
    sys.exit("no metrics to compare (a run failed, see its log)")
rows = [[json.loads(l) for l in open(p) if '"loss"' in l] for p in paths]
print(f"step  {name_a:<12}  {name_b:<12}  rel diff")
for a, b in zip(*rows):
    print(f"{a['step']:4d}  {a['loss']:<12.6f}  {b['loss']:<12.6f}  {abs(b['loss'] - a['loss']) / a['loss']:.2e}")
PY
}
# The calibration records of the training runs (train and calib parts), packed after each part
# so that a call cut short still returns what it finished.
mkdir -p "$OUT/calib"
pack_calib() { tar czf "$OUT/calib.tar.gz" -C "$OUT" calib 2>/dev/null; }
export PF_GPU_EXTRA_TARGETS="test_executor_cuda test_executor_device test_device pipefisher_train test_nccl_comm test_nccl_executor test_watchdog bench_nccl bench_device_kernels"

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
    timeout "${PF_GPU_TEST_TIMEOUT:-180}" "$t" 2>&1 | tee -a "$OUT/tests.log" |
      grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
fi

# The bf16-operands experiment (docs/cuda.md, "bf16 operands"), first in the bench part and
# alone as the bf16 part, each program under a limit of its own (PF_BF16_BENCH_TIMEOUT) so that
# the general limit cannot cut it: its tests (the products against the CPU's on rounded
# operands, the model's gradients, a pipeline's losses), then the GEMMs in bf16-operands, bf16,
# TF32 and fp32, the bf16-operand product and the conversion alone, and the BERT-Large stage in
# TF32, bf16 and bf16-operands. The general bench run then skips those benchmarks.
bf16_filter='^BM_Gemm/|^BM_GemmBf16OperandsProductOnly/|^BM_ConvertToBf16/|^BM_BertStageForwardBackward/(1|2|3)/'
if want bench || want bf16; then
  note "bf16-operands: tests, then against bf16 and TF32 (logs: tests_bf16.log, bench.log)"
  scripts/gpu_check.sh build >/dev/null 2>&1 || { note "bf16: build failed (build.log)"; status=1; }
  bf16_test() {  # bf16_test BINARY FILTER
    echo "== build/gpu/$1 --gtest_filter=$2" | tee -a "$OUT/tests_bf16.log"
    timeout "${PF_GPU_TEST_TIMEOUT:-180}" "build/gpu/$1" "--gtest_filter=$2" 2>&1 |
      tee -a "$OUT/tests_bf16.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  }
  bf16_test tests/kernels/test_kernels_cuda 'CudaOpsTest.*Bf16*'
  bf16_test tests/model/test_model_cuda BertCudaTest.LossesAndGradientsMatchTheCpu
  bf16_test tests/executor/test_executor_cuda ExecutorCuda.Bf16ProductsStayCloseToFp32
  PF_GPU_BENCHES="bench_cuda bench_model_cuda" PF_BENCH_FILTER="$bf16_filter" \
    PF_BENCH_TIMEOUT="${PF_BF16_BENCH_TIMEOUT:-120}" scripts/gpu_check.sh bench 2>&1 |
    grep -E "^BM_|error" | tee -a "$OUT/session.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
# The fused attention against the batched GEMMs (docs/cuda.md, "attention: fused vs batched"),
# second in the bench part and alone as the attention part, under a limit of its own: its tests
# (against the CPU, the batched path's dropout mask, bit-for-bit repeats), then the attention
# core and the BERT-Large layer with each algorithm. The general bench run then skips them.
attention_filter='^BM_AttentionForwardBackward/|^BM_BertLayerForwardBackward/(1|2)/'
if want bench || want attention; then
  note "attention: fused vs batched, tests then benchmarks (logs: tests_attention.log, bench.log)"
  scripts/gpu_check.sh build >/dev/null 2>&1 || { note "attention: build failed (build.log)"; status=1; }
  echo "== build/gpu/tests/kernels/test_kernels_cuda (attention)" | tee -a "$OUT/tests_attention.log"
  timeout "${PF_GPU_TEST_TIMEOUT:-180}" build/gpu/tests/kernels/test_kernels_cuda \
    '--gtest_filter=FusedAttentionTest.*:CudaOpsTest.*Attention*' 2>&1 |
    tee -a "$OUT/tests_attention.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  PF_GPU_BENCHES="bench_cuda" PF_BENCH_FILTER="$attention_filter" PF_BENCH_REPS="${PF_BENCH_REPS:-3}" \
    PF_BENCH_TIMEOUT="${PF_ATTENTION_BENCH_TIMEOUT:-120}" scripts/gpu_check.sh bench 2>&1 |
    grep -E "^BM_|error" | tee -a "$OUT/session.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if want bench; then
  note "CUDA benchmarks and the PyTorch baseline (logs: bench.log, torch.log)"
  PF_BENCH_FILTER="${PF_BENCH_FILTER:--$bf16_filter|$attention_filter}" scripts/gpu_check.sh bench torch 2>&1 |
    tail -n 200 >>"$OUT/session.log" || status=1
fi

train() {  # train NAME ARGS...: one pipefisher_train run, its log, its exit status
  local name=$1
  shift
  local limit=${PF_GPU_RUN_TIMEOUT:-150}
  if [[ -n "${PF_GPU_DEADLINE:-}" ]]; then
    local left=$((PF_GPU_DEADLINE - $(date +%s)))
    if ((left < 15)); then
      note "train $name: skipped, the lease's deadline is near"
      return 1
    fi
    ((left < limit)) && limit=$left
  fi
  echo "\$ pipefisher_train $*" >"$OUT/train_$name.log"
  timeout "$limit" "$bin" "$@" >>"$OUT/train_$name.log" 2>&1
  local rc=$?
  note "train $name: exit $rc (log: train_$name.log)"
  tail -n 4 "$OUT/train_$name.log" | tee -a "$OUT/session.log"
  return $rc
}

# The attention part, end to end: BERT-Large bf16 on one worker with each attention algorithm
# (host-timed seq/s in the step lines), and BERT-mini fp32 losses with each, side by side (the
# same dropout masks, so they agree to rounding).
if want attention; then
  if [[ ! -x $bin ]]; then
    note "attention: $bin is not built (run the build part)"
    status=1
  else
    for algorithm in batched fused; do
      train "attention_large_$algorithm" --data synthetic --seq-len 128 --seed 1 --log-every 2 \
        --model large --device cuda --precision bf16 --attention "$algorithm" --schedule 1f1b \
        --stages 1 --microbatches 4 --micro-batch-size 8 --steps 6 || status=1
      rm -f "$OUT/metrics_attention_$algorithm.jsonl"
      train "attention_mini_$algorithm" --data synthetic --seq-len 128 --seed 1 --log-every 1 \
        --model mini --device cuda --precision fp32 --attention "$algorithm" --schedule 1f1b \
        --stages 2 --microbatches 4 --micro-batch-size 4 --optimizer sgd --steps 6 \
        --metrics "$OUT/metrics_attention_$algorithm.jsonl" || status=1
    done
    compare_losses "batched" "fused" "$OUT/metrics_attention_batched.jsonl" \
      "$OUT/metrics_attention_fused.jsonl"
  fi
fi

if want train; then
  if [[ ! -x $bin ]]; then
    note "train: $bin is not built (run the build part)"
    status=1
  else
    common=(--data synthetic --seq-len 128 --seed 1 --log-every 5)
    # BERT-Large, micro-batch 8, one worker then 4 pipeline workers (1F1B) on the one GPU.
    train large_single "${common[@]}" --model large --device cuda --precision bf16 \
      --schedule 1f1b --stages 1 --microbatches 4 --micro-batch-size 8 --steps 10 \
      --trace "$OUT/trace_large_single.json" --profile-out "$OUT/profile_large_single.json" \
      --calibration-out "$OUT/calib/large_single.json" || status=1
    train large_1f1b_p4 "${common[@]}" --model large --device cuda --precision bf16 \
      --schedule 1f1b --stages 4 --microbatches 8 --micro-batch-size 8 --steps 10 \
      --trace "$OUT/trace_large_p4.json" --profile-out "$OUT/profile_large_p4.json" \
      --calibration-out "$OUT/calib/large_p4.json" || status=1
    # fp32 on the GPU against the CPU, same seed and schedule: the per-step losses side by side.
    small=("${common[@]}" --model mini --schedule 1f1b --stages 2 --microbatches 4
      --micro-batch-size 4 --optimizer sgd)
    rm -f "$OUT/metrics_gpu_fp32.jsonl" "$OUT/metrics_cpu_fp32.jsonl"
    train mini_gpu_fp32 "${small[@]}" --steps 6 --device cuda --precision fp32 \
      --metrics "$OUT/metrics_gpu_fp32.jsonl" || status=1
    train mini_cpu_fp32 "${small[@]}" --steps 6 --device cpu --precision fp32 \
      --metrics "$OUT/metrics_cpu_fp32.jsonl" || status=1
    compare_losses "cpu" "gpu" "$OUT/metrics_cpu_fp32.jsonl" "$OUT/metrics_gpu_fp32.jsonl"
    # K-FAC in the bubbles on the GPU, placed by the pass from the GPU's self-profile (the
    # schedule and the K-FAC kernels timed on the device); then BERT-Large, bf16, 1F1B p = 4.
    # (With held-out evaluation on the GPU's own copy of the model every 4 steps.)
    train mini_gpu_kfac "${small[@]}" --device cuda --precision fp32 --kfac --steps 8 \
      --eval-data synthetic --eval-every 4 --eval-batches 4 \
      --trace "$OUT/trace_mini_kfac.json" || status=1
    train large_1f1b_p4_kfac "${common[@]}" --model large --device cuda --precision bf16 \
      --schedule 1f1b --stages 4 --microbatches 8 --micro-batch-size 8 --steps 10 --kfac \
      --trace "$OUT/trace_large_p4_kfac.json" --profile-out "$OUT/profile_large_p4_kfac.json" \
      --calibration-out "$OUT/calib/large_p4_kfac.json" || status=1
    # The pipelined refresh on the GPU (the pass keeps it where it shortens the refresh).
    train mini_gpu_kfac_pipelined "${small[@]}" --device cuda --precision fp32 --kfac \
      --kfac-pipelined-refresh on --steps 8 || status=1
    # The curvature sync on the GPU: K-FAC with two data-parallel replicas.
    train mini_gpu_kfac_dp2 "${small[@]}" --device cuda --precision fp32 --kfac \
      --data-parallel 2 --steps 8 || status=1
    # K-FAC offload on the GPU (pinned host memory, copies on a copy stream per worker):
    # BERT-mini with every Linear offloaded. BERT-Large with and without offload is the
    # `offload` part's, both placed from one profile (two self-profiles place K-FAC differently,
    # and K-FAC from initialization is unstable enough that such runs diverge).
    train mini_gpu_kfac_offload "${small[@]}" --device cuda --precision fp32 --kfac \
      --kfac-offload host --steps 8 || status=1
    # K-FAC state sharded across two data-parallel replicas on the GPU.
    train mini_gpu_kfac_dp2_shard "${small[@]}" --device cuda --precision fp32 --kfac \
      --data-parallel 2 --kfac-sharding shard --steps 8 || status=1
    # Checkpoints on the GPU: K-FAC placed from one profile, 3 steps + save + resume to 6 vs 6
    # straight; per-step losses side by side and whether the files are byte-identical (the GPU's
    # kernels may sum in another order run to run: then the losses differ by rounding only).
    ck=("${small[@]}" --device cuda --precision fp32 --kfac --kfac-refresh 2 --lr-decay-steps 6)
    rm -rf "$OUT/ckpt_split" "$OUT/ckpt_straight" "$OUT"/metrics_ckpt_*.jsonl
    train mini_gpu_ckpt_profile "${ck[@]}" --steps 2 --profile-out "$OUT/profile_ckpt.json" ||
      status=1
    ck+=(--kfac-profile "$OUT/profile_ckpt.json")
    train mini_gpu_ckpt_first "${ck[@]}" --steps 3 --checkpoint-dir "$OUT/ckpt_split" \
      --metrics "$OUT/metrics_ckpt_split.jsonl" || status=1
    train mini_gpu_ckpt_resumed "${ck[@]}" --steps 6 --checkpoint-dir "$OUT/ckpt_split" --resume \
      --metrics "$OUT/metrics_ckpt_split.jsonl" || status=1
    train mini_gpu_ckpt_straight "${ck[@]}" --steps 6 --checkpoint-dir "$OUT/ckpt_straight" \
      --metrics "$OUT/metrics_ckpt_straight.jsonl" || status=1
    compare_losses "straight" "resumed" "$OUT/metrics_ckpt_straight.jsonl" "$OUT/metrics_ckpt_split.jsonl"
    for f in model optimizer kfac; do
      if cmp -s "$OUT/ckpt_split/step-00000006/$f.safetensors" \
        "$OUT/ckpt_straight/step-00000006/$f.safetensors"; then
        note "checkpoint resume on the GPU: $f.safetensors identical to the straight run's"
      else
        note "checkpoint resume on the GPU: $f.safetensors DIFFERS from the straight run's"
      fi
    done
    # No device visible: one error line, exit 2.
    CUDA_VISIBLE_DEVICES="" "$bin" --data synthetic --device cuda --steps 1 \
      >"$OUT/train_no_device.log" 2>&1
    rc=$?
    note "train no_device: exit $rc (expected 2): $(head -c 300 "$OUT/train_no_device.log")"
    [[ $rc -eq 2 ]] || status=1
    pack_calib
  fi
fi
if want offload; then
  # K-FAC offload against none on BERT-Large bf16 (1F1B, p = 4 on the one GPU), both placed from
  # one profile (a self-profiled placement differs run to run): the per-step losses side by side
  # (the GPU's kernels are deterministic, so they match bit for bit), the step times, and each
  # run's "K-FAC offload, measured" and "device memory: peak" lines (the memory offload saves).
  if [[ -x $bin ]]; then
    large=(--data synthetic --seq-len 128 --seed 1 --log-every 1 --model large --device cuda
      --precision bf16 --schedule 1f1b --stages 4 --microbatches 8 --micro-batch-size 8 --kfac)
    rm -f "$OUT"/metrics_offload_*.jsonl
    train offload_profile "${large[@]}" --steps 2 --profile-out "$OUT/profile_offload.json" ||
      status=1
    train offload_none "${large[@]}" --steps 8 --kfac-profile "$OUT/profile_offload.json" \
      --metrics "$OUT/metrics_offload_none.jsonl" || status=1
    train offload_host "${large[@]}" --steps 8 --kfac-profile "$OUT/profile_offload.json" \
      --kfac-offload host --metrics "$OUT/metrics_offload_host.jsonl" || status=1
    compare_losses "no offload" "offload" "$OUT/metrics_offload_none.jsonl" "$OUT/metrics_offload_host.jsonl"
    for run in none host; do
      note "offload_$run: $(grep -h "K-FAC offload, measured\|device memory: peak" \
        "$OUT/train_offload_$run.log" | tr '\n' ' ')"
    done
    # Per-step times side by side (docs/offload.md): before the pinned host memory was reserved
    # up front the steps with write-backs (2-4, 7-8) were the slow ones; and the executor's own
    # offload test on the GPU (pool, reserve and idle sums on the CUDA layer).
    python3 - "$OUT"/metrics_offload_{none,host}.jsonl <<'PY' | tee -a "$OUT/session.log"
import json, os, sys
if not all(os.path.exists(p) for p in sys.argv[1:]):
    sys.exit("no step times to compare (a run failed, see its log)")
rows = [[json.loads(l) for l in open(p) if '"step_time_s"' in l] for p in sys.argv[1:]]
for a, b in zip(*rows):
    print(f"step {a['step']}: {a['step_time_s']:.3f} s without offload, {b['step_time_s']:.3f} s with")
PY
    [[ -x build/gpu/tests/executor/test_executor_cuda ]] &&
      note "test_executor_cuda offload: $(build/gpu/tests/executor/test_executor_cuda \
        --gtest_filter='*KfacOffload*' 2>&1 | grep -E '^\[ +(PASSED|FAILED|SKIPPED) ' | tr '\n' ' ')"
  fi
fi

if want nccl; then
  nccl_test=build/gpu/tests/mpi/test_nccl_comm
  mpirun=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
  if ! command -v mpirun >/dev/null 2>&1; then
    note "nccl: no mpirun on this machine (install OpenMPI: scripts/setup.sh), nothing run"
    status=1
  elif ! {
    # mpirun itself crashed on one image (a segfault in PMIx's pmix_preg_base_generate_ppn):
    # try it on `true` plain, then with PMIx settings known to avoid PMIx crashes, and keep the
    # first that works (nccl_mpirun.log says which).
    mpi_ok=""
    for variant in "" "PMIX_MCA_preg=native" "PMIX_MCA_gds=hash" "PMIX_MCA_preg=native PMIX_MCA_gds=hash"; do
      if env $variant timeout 30 "${mpirun[@]}" -np 1 true >>"$OUT/nccl_mpirun.log" 2>&1; then
        mpi_ok=yes
        for setting in $variant; do export "${setting?}"; done
        note "nccl: mpirun works with '${variant:-no extra settings}'"
        break
      fi
      echo "== mpirun -np 1 true failed with '${variant}'" >>"$OUT/nccl_mpirun.log"
    done
    [[ -n $mpi_ok ]]
  }; then
    note "nccl: mpirun fails on this machine whatever the PMIx settings (log: nccl_mpirun.log)"
    status=1
  elif [[ ! -x $nccl_test ]]; then
    note "nccl: $nccl_test is not built (no NCCL found at configure time? see build.log)"
    status=1
  else
    note "nccl: one rank on the GPU (log: nccl.log)"
    { echo "\$ mpirun -np 1 $nccl_test"; timeout 300 "${mpirun[@]}" -np 1 "$nccl_test" --gtest_color=no; } \
      >>"$OUT/nccl.log" 2>&1
    rc=$?
    note "nccl np1: exit $rc: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/nccl.log" | tail -2 | tr '\n' ' ')$(grep -oE '^\[  SKIPPED \] [A-Za-z][A-Za-z0-9_./]+' "$OUT/nccl.log" | sort -u | wc -l) skipped"
    [[ $rc -eq 0 ]] || status=1
    # The executor over NCCL (one rank) against the threaded executor on the GPU.
    { echo "\$ mpirun -np 1 build/gpu/tests/mpi/test_nccl_executor"
      timeout 300 "${mpirun[@]}" -np 1 build/gpu/tests/mpi/test_nccl_executor --gtest_color=no; } \
      >"$OUT/nccl_executor.log" 2>&1
    rc=$?
    note "nccl executor np1: exit $rc (log: nccl_executor.log)"
    [[ $rc -eq 0 ]] || status=1
    # Our communicator's overheads against raw NCCL calls on one rank (docs/benchmarks.md, "NCCL
    # one-rank overheads"): the tables go to nccl.log, the summary lines to session.log.
    bench_nccl=build/gpu/bench/bench_nccl
    if [[ -x $bench_nccl ]]; then
      { echo "\$ mpirun -np 1 $bench_nccl --repeats 3"
        timeout "${PF_NCCL_BENCH_TIMEOUT:-25}" "${mpirun[@]}" -np 1 "$bench_nccl" --repeats 3; } \
        >"$OUT/nccl_bench.tmp" 2>&1
      rc=$?
      cat "$OUT/nccl_bench.tmp" >>"$OUT/nccl.log"
      note "nccl bench np1: exit $rc (tables in nccl.log)"
      grep -E "^# [^ ]|^#   (create|destroy)|^# +[0-9]+ B: |^bench_nccl|error" \
        "$OUT/nccl_bench.tmp" | tee -a "$OUT/session.log"
      rm -f "$OUT/nccl_bench.tmp"
      [[ $rc -eq 0 ]] || status=1
    else
      note "nccl bench: $bench_nccl is not built (see build.log)"
      status=1
    fi
    # Can this NCCL run 2 ranks on one GPU? Older releases refuse ("Duplicate GPU detected").
    note "nccl: 2 ranks on one GPU? (log: nccl_np2.log)"
    { echo "\$ PF_NCCL_SHARE_GPU=1 NCCL_DEBUG=WARN mpirun -np 2 $nccl_test"
      PF_NCCL_SHARE_GPU=1 NCCL_DEBUG=WARN timeout 300 "${mpirun[@]}" -x PF_NCCL_SHARE_GPU \
        -x NCCL_DEBUG -np 2 "$nccl_test" --gtest_color=no; } >"$OUT/nccl_np2.log" 2>&1
    rc=$?
    if grep -qi "duplicate GPU" "$OUT/nccl_np2.log"; then
      note "nccl np2 on one GPU: REFUSED by NCCL (Duplicate GPU detected), exit $rc"
    elif [[ $rc -eq 0 ]] && grep -q "SKIPPED" "$OUT/nccl_np2.log"; then
      note "nccl np2 on one GPU: skipped (no CUDA device visible?)"
    elif [[ $rc -eq 0 ]]; then
      note "nccl np2 on one GPU: RUNS (every 2-rank test passed); the executor over NCCL on 2 ranks:"
      PF_NCCL_SHARE_GPU=1 timeout 300 "${mpirun[@]}" -x PF_NCCL_SHARE_GPU -np 2 \
        build/gpu/tests/mpi/test_nccl_executor --gtest_color=no >"$OUT/nccl_executor_np2.log" 2>&1
      note "nccl executor np2 on one GPU: exit $? (log: nccl_executor_np2.log)"
    else
      note "nccl np2 on one GPU: failed otherwise, exit $rc (see nccl_np2.log)"
    fi
    if [[ -x $bin ]]; then
      # The training program's NCCL path: one rank under mpirun against the threaded run.
      tiny=(--model mini --data synthetic --seq-len 64 --micro-batch-size 4 --microbatches 4
        --steps 4 --seed 1 --optimizer sgd --log-every 1 --device cuda --precision fp32)
      rm -f "$OUT/metrics_nccl_np1.jsonl" "$OUT/metrics_threads_np1.jsonl"
      timeout 300 "${mpirun[@]}" -np 1 "$bin" "${tiny[@]}" --stages 1 \
        --metrics "$OUT/metrics_nccl_np1.jsonl" >"$OUT/train_nccl_np1.log" 2>&1
      rc=$?
      note "train nccl np1: exit $rc (log: train_nccl_np1.log)"
      [[ $rc -eq 0 ]] || status=1
      "$bin" "${tiny[@]}" --stages 1 --metrics "$OUT/metrics_threads_np1.jsonl" \
        >"$OUT/train_threads_np1.log" 2>&1 || status=1
      compare_losses "threads" "mpirun+nccl" "$OUT/metrics_threads_np1.jsonl" "$OUT/metrics_nccl_np1.jsonl"
      # Two ranks on the one GPU: each rank needs its own GPU, one error line, exit 2.
      timeout 120 "${mpirun[@]}" -np 2 "$bin" "${tiny[@]}" --stages 2 \
        >"$OUT/train_nccl_np2.log" 2>&1
      rc=$?
      note "train nccl np2 on one GPU: exit $rc (expected 2): $(grep -m1 error "$OUT/train_nccl_np2.log")"
      [[ $rc -eq 2 ]] || status=1
    fi
  fi
fi

if want calib; then
  # Records for `pipefisher_sim calibrate`: one worker at a second micro-batch size (per-kernel
  # costs against work-proportional ones), TF32 beside bf16 (the product rate against the rest),
  # two workers sharing the GPU, and the bf16 GEMMs (the first session's bench_cuda stopped
  # before them). Runs of 4 steps: the records are means over steps 2-4.
  if [[ ! -x $bin ]]; then
    note "calib: $bin is not built (run the build part)"
    status=1
  else
    note "calib: records for pipefisher_sim calibrate (log: session.log; files: calib.tar.gz)"
    calib=(--data synthetic --seq-len 128 --seed 1 --log-every 2 --model large --device cuda
      --steps 4)
    # The one-worker bf16 run at micro-batch 8 too (the train part writes its own, but a part
    # run in a call of its own sees only its $OUT: 2026-11-28's calib merge lacked it).
    [[ -f "$OUT/calib/large_single.json" ]] ||
      train large_single_mb8 "${calib[@]}" --precision bf16 --schedule 1f1b --stages 1 \
        --microbatches 4 --micro-batch-size 8 --calibration-out "$OUT/calib/large_single_mb8.json" ||
      status=1
    train large_single_mb32 "${calib[@]}" --precision bf16 --schedule 1f1b --stages 1 \
      --microbatches 2 --micro-batch-size 32 --calibration-out "$OUT/calib/large_single_mb32.json" ||
      status=1
    train large_single_tf32 "${calib[@]}" --precision tf32 --schedule 1f1b --stages 1 \
      --microbatches 4 --micro-batch-size 8 --calibration-out "$OUT/calib/large_single_tf32.json" ||
      status=1
    train large_1f1b_p2 "${calib[@]}" --precision bf16 --schedule 1f1b --stages 2 \
      --microbatches 4 --micro-batch-size 8 --calibration-out "$OUT/calib/large_p2.json" ||
      status=1
    # The kernels one class at a time (bench_device_kernels: GEMMs in fp32, TF32 and bf16,
    # the attention's batched products, element-wise kernels from launch-bound sizes up,
    # K-FAC's curvature, inversion chain and preconditioning, a LAMB step; ~30 s), and one
    # worker at micro-batch 1, 2, 4 and 16: the step records alone cannot tell the classes
    # apart (docs/simulator.md, "What would identify them").
    if [[ -x build/gpu/bench/bench_device_kernels ]]; then
      timeout "${PF_CALIB_KERNELS_TIMEOUT:-150}" build/gpu/bench/bench_device_kernels \
        --device cuda --out "$OUT/calib/kernels.json" >"$OUT/calib/kernels.log" 2>&1
      note "calib: bench_device_kernels: exit $? ($(tail -1 "$OUT/calib/kernels.log"))"
    fi
    for mb in 1 2 4 16; do
      train "large_single_mb$mb" "${calib[@]}" --precision bf16 --schedule 1f1b --stages 1 \
        --microbatches 4 --micro-batch-size "$mb" \
        --calibration-out "$OUT/calib/large_single_mb$mb.json" || status=1
    done
    if grep -qE "^BM_Gemm/[0-9]+/[0-9]+/[0-9]+/2/manual_time_median" "$OUT/bench.log" 2>/dev/null; then
      note "calib: bf16 GEMMs from the bench part's log"
    elif [[ -x build/gpu/bench/bench_cuda ]]; then
      timeout "${PF_CALIB_BENCH_TIMEOUT:-25}" build/gpu/bench/bench_cuda \
        --benchmark_filter='BM_Gemm/[0-9]+/[0-9]+/[0-9]+/2/' --benchmark_repetitions=3 \
        --benchmark_report_aggregates_only=true --benchmark_min_time=0.05 \
        >"$OUT/calib/gemm_bf16.log" 2>&1
      note "calib: bf16 GEMMs: exit $? ($(grep -c _median "$OUT/calib/gemm_bf16.log") medians)"
    fi
    trains=()
    for f in "$OUT"/calib/large_*.json; do
      [[ -f $f ]] && trains+=("$(basename "$f" .json)=$f")
    done
    python3 scripts/gpu_calibration.py records --out "$OUT/calib/measurements.json" \
      --bench "$OUT/bench.log" "$OUT/calib/gemm_bf16.log" --train "${trains[@]}" \
      --kernels "$OUT/calib/kernels.json" \
      --description "scripts/gpu_session.sh calib (and train, bench) on $(hostname)" \
      --provenance "date=$(date -u +%FT%TZ)" \
      "device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" \
      "driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)" \
      "commit=${PF_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" 2>&1 |
      tee -a "$OUT/session.log" || status=1
    pack_calib
  fi
fi

note "done, status $status"
exit $status
