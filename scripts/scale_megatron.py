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
  --calibrate-shape
                fit the shape-dependent product efficiency instead: two numbers, the efficiency e
                of the largest products (gemm and attention classes) and the harmonic-mean size h
                at which a product reaches half of it (gemm class: e / (1 + h / s), s = 3 / (1/m +
                1/n + 1/k) of each product), once, to the whole table (least squares of the
                log errors of all ten rows), and write them to --device.
  --before DEVICE
                also predict every row with DEVICE and print both columns (the doc's table keeps
                the one-efficiency numbers beside the shape-dependent ones).

Usage:
  python3 scripts/scale_megatron.py --sim build/release/sim/cli/pipefisher_sim \
      --device sim/calibration/a100_megatron.json [--calibrate]
  python3 scripts/scale_megatron.py --sim build/release/sim/cli/pipefisher_sim \
      --device sim/calibration/a100_megatron_shape.json --calibrate-shape \
      --before sim/calibration/a100_megatron.json
"""
import argparse
import concurrent.futures
import json
import math
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


SIZE_MEASURE = "harmonic_mean"


def a100_shape_device(efficiency, half_size):
    """The a100 preset with a shape-dependent product efficiency."""
    device = a100_device(efficiency)
    device["name"] = "a100-megatron-shape"
    device["classes"]["gemm"] = {"efficiency": efficiency, "half_efficiency_size": half_size,
                                 "size_exponent": 1.0, "size_measure": SIZE_MEASURE}
    return device


def predict_all(sim, device):
    """Every row's best candidate, the rows run side by side."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda row: predict(sim, device, row), PAPER_ROWS))


def calibrate_shape(sim, device_path):
    """Nelder-Mead over (e, log h) on the sum of squared log errors of all rows."""
    def loss(x):
        efficiency, half_size = x[0], math.exp(x[1])
        if not 0.2 < efficiency <= 1.0:
            return 1e9
        with open(device_path, "w") as f:
            json.dump(a100_shape_device(efficiency, half_size), f, indent=1)
        bests = predict_all(sim, device_path)
        return sum(math.log(best["achieved_tflops_per_gpu"] / row[6]) ** 2
                   for best, row in zip(bests, PAPER_ROWS))

    simplex = [[0.75, math.log(500.0)], [0.85, math.log(500.0)], [0.75, math.log(1500.0)]]
    values = [loss(x) for x in simplex]
    for _ in range(40):
        order = sorted(range(3), key=lambda i: values[i])
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        centroid = [(simplex[0][j] + simplex[1][j]) / 2 for j in range(2)]
        reflected = [2 * centroid[j] - simplex[2][j] for j in range(2)]
        value = loss(reflected)
        if value < values[0]:
            expanded = [3 * centroid[j] - 2 * simplex[2][j] for j in range(2)]
            expanded_value = loss(expanded)
            simplex[2], values[2] = ((expanded, expanded_value) if expanded_value < value
                                     else (reflected, value))
        elif value < values[1]:
            simplex[2], values[2] = reflected, value
        else:
            contracted = [(centroid[j] + simplex[2][j]) / 2 for j in range(2)]
            contracted_value = loss(contracted)
            if contracted_value < values[2]:
                simplex[2], values[2] = contracted, contracted_value
            else:
                for i in (1, 2):
                    simplex[i] = [(simplex[0][j] + simplex[i][j]) / 2 for j in range(2)]
                    values[i] = loss(simplex[i])
        if max(values) - min(values) < 1e-6:
            break
    best = min(range(3), key=lambda i: values[i])
    efficiency = round(simplex[best][0], 4)
    half_size = round(math.exp(simplex[best][1]), 1)
    with open(device_path, "w") as f:
        json.dump(a100_shape_device(efficiency, half_size), f, indent=1)
        f.write("\n")
    print(f"calibrated: product efficiency {efficiency}, half-efficiency harmonic-mean size "
          f"{half_size} (all ten rows) -> {device_path}", file=sys.stderr)


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
    parser.add_argument("--calibrate-shape", action="store_true")
    parser.add_argument("--before", help="a device to predict the rows with too")
    parser.add_argument("--size-measure", choices=["harmonic_mean", "smallest"],
                        default="harmonic_mean",
                        help="with --calibrate-shape: the product size the curve reads")
    args = parser.parse_args()
    global SIZE_MEASURE
    SIZE_MEASURE = args.size_measure
    if args.calibrate:
        calibrate(args.sim, args.device)
    if args.calibrate_shape:
        calibrate_shape(args.sim, args.device)
    bests = predict_all(args.sim, args.device)
    befores = predict_all(args.sim, args.before) if args.before else [None] * len(PAPER_ROWS)
    before_head = "before | error before | " if args.before else ""
    print(f"| model | t | p | d | GPUs | B | paper TFLOP/s/GPU | {before_head}predicted | error | "
          "best schedule, b, m | predicted step time | memory |")
    print("|---" * (12 + (2 if args.before else 0)) + "|")
    errors, errors_before = [], []
    for row, best, before in zip(PAPER_ROWS, bests, befores):
        model, billions, t, p, gpus, batch, paper = row
        achieved = best["achieved_tflops_per_gpu"]
        error = achieved / paper - 1
        errors.append(abs(error))
        before_cells = ""
        if before:
            error_before = before["achieved_tflops_per_gpu"] / paper - 1
            errors_before.append(abs(error_before))
            before_cells = (f"{before['achieved_tflops_per_gpu']:.1f} | "
                            f"{100 * error_before:+.1f}% | ")
        schedule = best["schedule"] + (f" v={best['chunks_per_worker']}"
                                       if best["schedule"] == "interleaved" else "")
        print(f"| {billions}B | {t} | {p} | {gpus // (t * p)} | {gpus} | {batch} | {paper} | "
              f"{before_cells}{achieved:.1f} | {100 * error:+.1f}% | {schedule}, "
              f"b={best['micro_batch_size']}, m={best['microbatches']} | "
              f"{best['step_time_s']:.2f} s | {best['peak_memory_bytes'] / 2**30:.1f} GiB |")

    def summary(values):
        values = sorted(values)
        n = len(values)
        median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
        return f"median |error| {100 * median:.1f}%, worst {100 * values[-1]:.1f}%"

    print()
    if args.before:
        print(f"before ({args.before}): {summary(errors_before)}")
    print(f"{args.device}: {summary(errors)}")


if __name__ == "__main__":
    main()
