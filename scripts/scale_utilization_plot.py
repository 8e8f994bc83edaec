#!/usr/bin/env python3
"""Predicted utilization before and after PipeFisher against the number of micro-batches.

Runs pipefisher_sim with --kfac --report for m = p, 2p, 4p, ... on two setups (the command of each
point is printed) and plots 1 - bubble before and after filling the bubbles with K-FAC work:
  - BERT-Large, 1F1B over 8 stages of one DGX A100 node (t = 1, the BERT analytic model, bf16,
    micro-batch 8, S = 128);
  - GPT-3 175B, 1F1B, t = 8, p = 16 on dgx-a100 (the parallel model, bf16, micro-batch 1,
    S = 2048, selective recomputation).

Usage: python3 scripts/scale_utilization_plot.py --sim build/release/sim/cli/pipefisher_sim \
           --out docs/figures/scale_utilization.png [--csv docs/figures/scale_utilization.csv]
"""
import argparse
import json
import os
import subprocess
import tempfile

SETUPS = {
    "BERT-Large, 1F1B, p=8 (A100, b=8)": (
        8, ["--model", "large", "--device", "a100", "--seq-len", "128", "--micro-batch-size", "8",
            "--precision", "bf16"]),
    "GPT-3 175B, 1F1B, t=8 p=16 (dgx-a100, b=1)": (
        16, ["--model", "gpt3-175b", "--cluster", "dgx-a100", "--tensor-parallel", "8",
             "--seq-len", "2048", "--micro-batch-size", "1", "--precision", "bf16",
             "--recompute", "selective"]),
}
MULTIPLES = [1, 2, 4, 8, 16]


def run(sim, p, m, extra):
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "r.json")
        command = [sim, "--schedule", "1f1b", "-p", str(p), "-m", str(m), "--grid", "none",
                   "--kfac", "--report", report] + extra
        print(" ".join(command))
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(report) as f:
            kfac = json.load(f)["kfac"]
    return kfac["utilization_before"], kfac["utilization_after"], kfac["refresh_steps"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--csv")
    args = parser.parse_args()
    rows = []
    for name, (p, extra) in SETUPS.items():
        for multiple in MULTIPLES:
            m = p * multiple
            before, after, k = run(args.sim, p, m, extra)
            rows.append((name, p, m, before, after, k))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("setup,p,m,utilization_before,utilization_after,refresh_steps\n")
            for row in rows:
                f.write(f"\"{row[0]}\",{row[1]},{row[2]},{row[3]:.4f},{row[4]:.4f},{row[5]}\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for (name, _), colour in zip(SETUPS.items(), ["tab:blue", "tab:red"]):
        points = [r for r in rows if r[0] == name]
        ms = [r[2] for r in points]
        axis.plot(ms, [100 * r[3] for r in points], "o--", color=colour, label=f"{name}: before")
        axis.plot(ms, [100 * r[4] for r in points], "o-", color=colour,
                  label=f"{name}: with K-FAC in the bubbles")
        for r in points:
            axis.annotate(f"k={r[5]}", (r[2], 100 * r[4]), textcoords="offset points",
                          xytext=(0, 5), fontsize=7, color=colour, ha="center")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("micro-batches per step m")
    axis.set_ylabel("predicted utilization (%)")
    axis.set_title("PipeFisher: utilization before / after vs micro-batches")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
