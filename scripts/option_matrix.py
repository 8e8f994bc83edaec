#!/usr/bin/env python3
"""Runs pipefisher_train over a matrix of layouts and K-FAC options on a tiny BERT and synthetic
data, and reports every run that neither succeeds nor is refused with exit status 2 and an
"error:" line (a crash, a failure in training, a hang past the timeout). The PipeFisher pass
places K-FAC work from each run's own self-profile, so repeated rounds see different plans:
run several (--rounds). Found the pipelined refresh + data-parallel bug of 2026-11-29.

  scripts/option_matrix.py build/release/runtime/train/pipefisher_train [--rounds 3]
      [--mpirun "mpiexec --oversubscribe"] [--work DIR]

With --mpirun, each layout runs as one process per rank instead of worker threads.
"""
import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile

LAYOUTS = [
    ["--schedule", "gpipe", "--stages", "2"],
    ["--schedule", "1f1b", "--stages", "2"],
    ["--schedule", "1f1b", "--stages", "4"],
    ["--schedule", "interleaved", "--stages", "2", "--chunks", "2"],
    ["--schedule", "chimera", "--stages", "2"],
    ["--schedule", "chimera", "--stages", "4"],
    ["--schedule", "1f1b", "--stages", "2", "--split-backward"],
]
REPLICAS = [1, 2]
KFAC = [
    [],
    ["--kfac"],
    ["--kfac", "--kfac-refresh", "2"],
    ["--kfac", "--kfac-pipelined-refresh", "on"],
    ["--kfac", "--kfac-pipelined-refresh", "on", "--kfac-refresh", "2"],
    ["--kfac", "--kfac-split", "off"],
    ["--kfac", "--kfac-curvature", "every_step"],
    ["--kfac", "--kfac-sharding", "shard"],
    ["--kfac", "--kfac-offload", "host"],
    ["--kfac", "--kfac-warmup-steps", "3"],
    ["--kfac", "--kfac-warmup-steps", "3", "--kfac-pipelined-refresh", "on"],
    ["--kfac", "--kfac-warmup-steps", "3", "--kfac-offload", "host"],
    ["--kfac", "--kfac-warmup-steps", "3", "--kfac-sharding", "shard"],
    ["--kfac", "--kfac-refresh", "3", "--kfac-warmup-steps", "4", "--checkpoint-every", "2"],
    ["--kfac", "--kfac-policy", "best_fit"],
    ["--kfac", "--kfac-move-w", "on"],
]
CONFIG = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
          "intermediate_size": 32, "max_position_embeddings": 32, "type_vocab_size": 2,
          "model_type": "bert"}


def ranks(layout, replicas):
    stages = int(layout[layout.index("--stages") + 1])
    return stages * replicas


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", help="the pipefisher_train binary")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--mpirun", default="", help="launcher and its options (one process per rank)")
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per run")
    args = parser.parse_args()
    train = os.path.realpath(args.train)
    work = args.work or tempfile.mkdtemp(prefix="pf_option_matrix_")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    runs = failures = refusals = 0
    for _ in range(args.rounds):
        for layout, replicas, kfac in itertools.product(LAYOUTS, REPLICAS, KFAC):
            if "--kfac-sharding" in kfac and replicas == 1:
                continue  # sharding needs replicas
            if "--kfac-move-w" in kfac and "--split-backward" not in layout:
                continue  # a zero-bubble option
            flags = layout + ["--data-parallel", str(replicas)] + kfac
            if "--checkpoint-every" in kfac:
                flags += ["--checkpoint-dir", os.path.join(work, "ckpt")]
                subprocess.run(["rm", "-rf", os.path.join(work, "ckpt")], check=True)
            command = [train, "--model", "config.json", "--data", "synthetic", "--seq-len", "12",
                       "--micro-batch-size", "2", "--microbatches", "4", "--steps", "7", "--quiet",
                       "--wait-timeout", "60"] + flags
            if args.mpirun:
                command = shlex.split(args.mpirun) + ["-np", str(ranks(layout, replicas))] + command
            runs += 1
            try:
                done = subprocess.run(command, cwd=work, capture_output=True, text=True,
                                      timeout=args.timeout)
                status, text = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired:
                status, text = "timeout", ""
            if status == 0:
                continue
            lines = [l for l in text.splitlines() if "error" in l.lower() or "failed" in l.lower()]
            if status == 2 and any("error:" in l for l in lines):
                refusals += 1
                continue
            failures += 1
            print(f"FAILED ({status}): {' '.join(flags)}\n  {lines[0] if lines else text[-400:]}",
                  flush=True)
    print(f"option_matrix: {runs} runs, {failures} failed, {refusals} refused with a message "
          f"(work: {work})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
