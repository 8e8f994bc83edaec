#!/usr/bin/env python3
"""The Megatron-LM PTD-P paper's weak-scaling table against pipefisher_sim's predictions.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT models of 1.7B to 1T parameters (vocabulary 51200, sequence
2048, fp16, activation recomputation) on Selene's DGX A100 80 GB nodes, with the tensor- (t) and
pipeline-parallel (p) sizes, GPUs, batch sizes and achieved teraFLOP/s per GPU it reports.

For each row the simulator searches the paper's (t, p, d = GPUs / (t p), B) with full
recomputation over the micro-batch size (1, 2, 4, 8) and the schedule (1F1B, interleaved v = 2, 4)
and reports its best predicted achieved TFLOP/s per GPU (counting FLOPs as the paper does, 96 B s l
h^2 (1 + s / 6h + V / 16 l h) per step).

  --calibrate   fit one number, the A100's fp16 matrix-product efficiency (gemm and attention
                classes), to the first row alone (t = p = 1: no tensor or pipeline communication,
                so the row measures the device), and write it to --device. Done once; every other
                row is a prediction.

Usage:
  python3 scripts/scale_megatron.py --sim build/release/sim/cli/pipefisher_sim \
      --device sim/calibration/a100_megatron.json [--calibrate] [--markdown]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# (model preset, parameters in billions, t, p, GPUs, batch size, achieved TFLOP/s per GPU)
PAPER_ROWS = [
    ("megatron-1.7b", 1.7, 1, 1, 32, 512, 137),
    ("megatron-3.6b", 3.6, 2, 1, 64, 512, 138),
    ("megatron-7.5b", 7.5, 4, 1, 128, 512, 142),
    ("megatron-18.4b", 18.4, 8, 1, 256, 1024, 135),
    ("megatron-39.1b", 39.1, 8, 2, 512, 1536, 138),
    ("megatron-76.1b", 76.1, 8, 4, 1024, 1792, 140),
    ("megatron-145.6b", 145.6, 8, 8, 1536, 2304, 148),
    ("megatron-310.1b", 310.1, 8, 16, 1920, 2160, 155),
    ("megatron-529.6b", 529.6, 8, 35, 2520, 2520, 163),
    ("megatron-1t", 1008.0, 8, 64, 3072, 3072, 163),
]


def a100_device(efficiency):
    """The a100 preset with one matrix-product efficiency for the gemm and attention classes."""
    return {
        "name": "a100-megatron",
        "peak_flops": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        "matmul_efficiency": efficiency,
        "memory_bandwidth": 2.0e12,
        "link_bandwidth": 300e9,
        "link_latency_s": 5e-6,
        "classes": {"gemm": {"efficiency": efficiency}, "attention": {"efficiency": efficiency}},
    }


def predict(sim, device, row):
    model, _, t, p, gpus, batch, _ = row
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "row.json")
        command = [sim, "search", "--model", model, "--gpus", str(gpus), "--global-batch",
                   str(batch), "--cluster", "dgx-a100", "--device", device, "--precision", "fp16",
                   "--seq-len", "2048", "--tensor-parallel", str(t), "--stages", str(p),
                   "--recompute", "full", "--schedules", "1f1b,interleaved", "--top", "1",
                   "--simulate-top", "8", "--zero-stages", "0", "--optimizer-offload", "none",
                   "--out", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            result = json.load(f)
    best = result["candidates"][0]
    return best


def calibrate(sim, device_path):
    low, high = 0.3, 1.0
    target = PAPER_ROWS[0][6]
    for _ in range(30):
        middle = (low + high) / 2
        with open(device_path, "w") as f:
            json.dump(a100_device(middle), f, indent=1)
        achieved = predict(sim, device_path, PAPER_ROWS[0])["achieved_tflops_per_gpu"]
        if achieved < target:
            low = middle
        else:
            high = middle
    efficiency = round((low + high) / 2, 4)
    with open(device_path, "w") as f:
        json.dump(a100_device(efficiency), f, indent=1)
        f.write("\n")
    print(f"calibrated: gemm / attention efficiency {efficiency} (row 1 alone) -> {device_path}",
          file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim", required=True, help="path to pipefisher_sim")
    parser.add_argument("--device", required=True, help="the A100 device file")
    parser.add_argument("--calibrate", action="store_true")
    args = parser.parse_args()
    if args.calibrate:
        calibrate(args.sim, args.device)
    print("| model | t | p | d | GPUs | B | paper TFLOP/s/GPU | predicted | error | "
          "best schedule, b, m | predicted step time | memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for row in PAPER_ROWS:
        model, billions, t, p, gpus, batch, paper = row
        best = predict(args.sim, args.device, row)
        achieved = best["achieved_tflops_per_gpu"]
        error = achieved / paper - 1
        errors.append(abs(error))
        schedule = best["schedule"] + (f" v={best['chunks_per_worker']}"
                                       if best["schedule"] == "interleaved" else "")
        print(f"| {billions}B | {t} | {p} | {gpus // (t * p)} | {gpus} | {batch} | {paper} | "
              f"{achieved:.1f} | {100 * error:+.1f}% | {schedule}, b={best['micro_batch_size']}, "
              f"m={best['microbatches']} | {best['step_time_s']:.2f} s | "
              f"{best['peak_memory_bytes'] / 2**30:.1f} GiB |")
    errors.sort()
    median = errors[len(errors) // 2] if len(errors) % 2 else (
        errors[len(errors) // 2 - 1] + errors[len(errors) // 2]) / 2
    print(f"\nmedian |error| {100 * median:.1f}%, worst {100 * errors[-1]:.1f}%")


if __name__ == "__main__":
    main()
