#!/usr/bin/env python3
"""Runs pipefisher_train over a matrix of layouts and K-FAC options on a tiny BERT and synthetic
data (K-FAC's options, and precision, optimizers, evaluation, buckets and threads beside
them), and reports every run that neither succeeds nor is refused with exit status 2 and an
"error:" line (a crash, a failure in training, a hang past the timeout). The PipeFisher pass
places K-FAC work from each run's own self-profile, so repeated rounds see different plans:
run several (--rounds). Found the pipelined refresh + data-parallel bug of 2026-11-29.

  scripts/option_matrix.py build/release/runtime/train/pipefisher_train [--rounds 3]
      [--mpirun "mpiexec --oversubscribe"] [--resume] [--work DIR]

With --mpirun, each layout runs as one process per rank instead of worker threads. With
--resume, every run that succeeds saves checkpoints and runs again from its earliest kept one
before the end (--resume, the same flags): its later steps must equal the straight run's, loss
and gradient norm (and held-out loss) bit for bit (a refusal counts as a failure there). Each
K-FAC run then resumes that checkpoint once more with --kfac-replan
--kfac-refresh 2, and with data-parallel replicas once more with --kfac-replan and another
--kfac-sharding (replicated state sharded, sharded replicated): each must succeed or be refused
with a message (at step 4 inside a window of the checkpoint's interval, e.g.). Found the
unreadable per-component placement of --kfac-sharding auto (2026-11-29).
"""
import argparse
import collections
import itertools
import json
import os
import shlex
import shutil
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
    ["--kfac", "--kfac-sharding", "auto"],
    ["--kfac", "--kfac-sharding", "factors=shard,inverses=replicate"],
    ["--kfac", "--kfac-offload", "host"],
    ["--kfac", "--kfac-warmup-steps", "3"],
    ["--kfac", "--kfac-warmup-steps", "3", "--kfac-pipelined-refresh", "on"],
    ["--kfac", "--kfac-warmup-steps", "3", "--kfac-offload", "host"],
    ["--kfac", "--kfac-warmup-steps", "3", "--kfac-sharding", "shard"],
    ["--kfac", "--kfac-refresh", "3", "--kfac-warmup-steps", "4", "--checkpoint-every", "2"],
    ["--kfac", "--kfac-policy", "best_fit"],
    ["--kfac", "--kfac-move-w", "on"],
    # Beyond K-FAC's own options: precision, optimizers, evaluation, buckets, threads.
    ["--precision", "fp64"],
    ["--precision", "fp64", "--optimizer", "adamw", "--dp-bucket-mb", "0"],
    ["--optimizer", "sgd", "--momentum", "0.9", "--dp-bucket-mb", "0.01"],
    ["--kfac", "--kfac-linears", "query,ffn_out", "--kfac-layers", "1-2"],
    ["--kfac", "--kfac-offload", "factors"],
    ["--kfac", "--kfac-offload", "auto", "--device-memory-budget", "1"],
    ["--kfac", "--kfac-spill-budget", "0.02"],
    ["--kfac", "--kfac-free-spill", "on"],
    ["--kfac", "--kfac-curvature", "every_step", "--kfac-refresh", "2", "--kfac-warmup-steps", "2"],
    ["--kfac", "--eval-data", "synthetic", "--eval-every", "3", "--eval-batches", "2"],
    ["--kfac", "--threads-per-worker", "2", "--kfac-refresh", "2"],
    ["--kfac", "--kfac-pipelined-refresh", "on", "--kfac-offload", "host"],
    ["--kfac", "--kfac-pipelined-refresh", "on", "--kfac-split", "off", "--kfac-refresh", "2"],
    ["--kfac", "--kfac-policy", "best_of_both", "--kfac-max-refresh", "4"],
]
CONFIG = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
          "intermediate_size": 32, "max_position_embeddings": 32, "type_vocab_size": 2,
          "model_type": "bert"}


def ranks(layout, replicas):
    stages = int(layout[layout.index("--stages") + 1])
    return stages * replicas


def run(command, work, timeout):
    try:
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        return "timeout", ""


def step_records(path):
    """(step, loss, gradient norm) of each step record of a metrics file, and (step, "eval",
    held-out loss) of each evaluation."""
    records = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            kind = record.get("kind", "step")
            if kind == "step":
                records.append((record["step"], record["loss"], record["grad_norm"]))
            elif kind == "eval":
                records.append((record["step"], "eval", record["eval_loss"]))
    return records


def error_lines(text):
    return [l for l in text.splitlines() if "error" in l.lower() or "failed" in l.lower()]


def refusal(status, text):
    """The "error:" line of a run refused with a message (exit status 2), else None."""
    if status != 2:
        return None
    return next((l for l in error_lines(text) if "error:" in l), None)


def first_error(text):
    lines = error_lines(text)
    return lines[0] if lines else text[-400:]


def saved_steps(checkpoints):
    return sorted(int(name[len("step-"):]) for name in os.listdir(checkpoints)
                  if name.startswith("step-"))


def rewind(checkpoints, start):
    """Leaves the checkpoint of step `start` the latest: the later ones removed."""
    for step in saved_steps(checkpoints):
        if step > start:
            shutil.rmtree(os.path.join(checkpoints, f"step-{step:08d}"))
    with open(os.path.join(checkpoints, "latest"), "w") as f:
        f.write(f"step-{start:08d}\n")


def check_resume(command, checkpoints, work, timeout):
    """Resumes the straight run's earliest kept checkpoint before its end; a message or None."""
    steps = saved_steps(checkpoints)
    earlier = [step for step in steps if step < 7]
    if not earlier:
        return f"no checkpoint before step 7 (kept: {steps})"
    start = earlier[0]
    rewind(checkpoints, start)
    resumed = [("resumed.jsonl" if word == "straight.jsonl" else word) for word in command]
    status, text = run(resumed + ["--resume"], work, timeout)
    if status != 0:
        return f"resume from step {start} exited {status}: {first_error(text)}"
    straight = [r for r in step_records(os.path.join(work, "straight.jsonl")) if r[0] > start]
    again = step_records(os.path.join(work, "resumed.jsonl"))
    if again != straight:
        first = next((i for i, (a, b) in enumerate(zip(again, straight)) if a != b),
                     min(len(again), len(straight)))
        return (f"resumed from step {start}: (step, loss, gradient norm) record "
                f"{again[first] if first < len(again) else 'none'} against the straight run's "
                f"{straight[first] if first < len(straight) else 'none'}")
    return None


def check_replan(command, checkpoints, work, timeout, flag="--kfac-refresh", value="2"):
    """Resumes the same checkpoint again with --kfac-replan and `flag value` in place of the
    run's own (another refresh interval and, mostly, another plan; or another placement of the
    K-FAC state): it must succeed or be refused with a message. Returns (message or None,
    the refusal's message or None)."""
    start = saved_steps(checkpoints)[0]
    rewind(checkpoints, start)
    if os.path.exists(os.path.join(work, "replanned.jsonl")):
        os.remove(os.path.join(work, "replanned.jsonl"))
    replanned = []
    skip = False
    for word in command:
        if skip:
            skip = False
        elif word == flag:
            skip = True
        else:
            replanned.append("replanned.jsonl" if word == "straight.jsonl" else word)
    status, text = run(replanned + ["--resume", "--kfac-replan", flag, value], work, timeout)
    if status == 0:
        return None, None
    reason = refusal(status, text)
    if reason:
        return None, reason
    return (f"--kfac-replan {flag} {value} from step {start} exited {status}: "
            f"{first_error(text)}"), None


def other_placement(command):
    """Another --kfac-sharding than the run's: replicated state sharded, sharded replicated."""
    if "--kfac-sharding" not in command:
        return "shard"
    return "shard" if command[command.index("--kfac-sharding") + 1] == "replicate" else "replicate"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", help="the pipefisher_train binary")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--mpirun", default="", help="launcher and its options (one process per rank)")
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per run")
    parser.add_argument("--resume", action="store_true",
                        help="resume each successful run from a checkpoint and compare its steps")
    args = parser.parse_args()
    train = os.path.realpath(args.train)
    work = args.work or tempfile.mkdtemp(prefix="pf_option_matrix_")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    runs = failures = refusals = resumes = replans = replans_refused = moves = moves_refused = 0
    reasons = collections.Counter()  # the refusals' messages (their start)
    for _ in range(args.rounds):
        for layout, replicas, kfac in itertools.product(LAYOUTS, REPLICAS, KFAC):
            if "--kfac-sharding" in kfac and replicas == 1:
                continue  # sharding needs replicas
            if "--kfac-move-w" in kfac and "--split-backward" not in layout:
                continue  # a zero-bubble option
            flags = layout + ["--data-parallel", str(replicas)] + kfac
            checkpoints = os.path.join(work, "ckpt")
            shutil.rmtree(checkpoints, ignore_errors=True)
            for metrics in ("straight.jsonl", "resumed.jsonl"):  # a metrics file is appended to
                if os.path.exists(os.path.join(work, metrics)):
                    os.remove(os.path.join(work, metrics))
            if "--checkpoint-every" in kfac:
                flags += ["--checkpoint-dir", checkpoints]
            elif args.resume:
                flags += ["--checkpoint-dir", checkpoints, "--checkpoint-every", "4"]
            command = [train, "--model", "config.json", "--data", "synthetic", "--seq-len", "12",
                       "--micro-batch-size", "2", "--microbatches", "4", "--steps", "7", "--quiet",
                       "--wait-timeout", "60", "--metrics", "straight.jsonl"] + flags
            if args.mpirun:
                command = shlex.split(args.mpirun) + ["-np", str(ranks(layout, replicas))] + command
            runs += 1
            status, text = run(command, work, args.timeout)
            if status == 0:
                if args.resume:
                    resumes += 1
                    problem = check_resume(command, checkpoints, work, args.timeout)
                    if not problem and "--kfac" in kfac:
                        replans += 1
                        problem, refused = check_replan(command, checkpoints, work, args.timeout)
                        if refused:
                            replans_refused += 1
                            reasons["replan: " + refused[:100]] += 1
                    if not problem and "--kfac" in kfac and replicas > 1:
                        moves += 1
                        problem, refused = check_replan(command, checkpoints, work, args.timeout,
                                                        "--kfac-sharding", other_placement(command))
                        if refused:
                            moves_refused += 1
                            reasons["another placement: " + refused[:100]] += 1
                    if problem:
                        failures += 1
                        print(f"RESUME FAILED: {' '.join(flags)}\n  {problem}", flush=True)
                continue
            reason = refusal(status, text)
            if reason:
                refusals += 1
                reasons[reason[:110]] += 1
                continue
            failures += 1
            print(f"FAILED ({status}): {' '.join(flags)}\n  {first_error(text)}", flush=True)
    for reason, count in reasons.most_common():
        print(f"refused {count}x: {reason}")
    print(f"option_matrix: {runs} runs, {resumes} resumed, {failures} failed, {refusals} refused "
          f"with a message" + (f"; {replans} resumed again with --kfac-replan --kfac-refresh 2, "
                               f"{replans_refused} of them refused with a message; {moves} with "
                               f"--kfac-replan and another --kfac-sharding, {moves_refused} of "
                               f"them refused with a message"
                               if args.resume else "") + f" (work: {work})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
