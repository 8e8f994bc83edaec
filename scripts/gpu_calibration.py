#!/usr/bin/env python3
"""The simulator's GPU device from a GPU session's measurements (issue #19).

  gpu_calibration.py records --out M.json [--bench LOG ...] [--train NAME=FILE.json ...]
                     [--kernels FILE.json ...] [--description TEXT] [--provenance KEY=VALUE ...]
      One measurements file (docs/simulator.md, "Calibration") from what
      `scripts/gpu_session.sh calib` leaves in $OUT/calib: the console logs of bench_cuda
      (BM_Gemm: one "gemm" record per shape and precision) and bench_model_cuda
      (BM_BertStageForwardBackward: one "chunk_forward_backward" record per precision; the
      medians of the repetitions), and pipefisher_train --calibration-out files (every record
      tagged "case": NAME), and bench_device_kernels files (the runtime's kernels one class at
      a time: "case" kernels-OPERATION, or kernels-OPERATION-PRECISION for products). Records
      get "case" and "set" (gemm, stage, train, kernels) for --hold-out.

  gpu_calibration.py fit M.json --out-dir DIR [--sim BIN] [--start h200] [--group case]
                     [--free] [--name NAME] [--hold-out FIELD=VALUE ...]
      Fits a device to every record (those marked "stale": true held out) and writes
      DIR/device.json, then refits once per value of --group with that group held out and
      prints each held-out record's error: the check that the device predicts what it was
      not fitted on. Without --free only the flat model's rates are fitted (per-precision GEMM,
      attention and element-wise efficiencies, launch overheads; the class latencies, size and
      cache curves and per-element terms kept at the start device's): with a dozen records the
      extra parameters trade against each other and the held-out errors are worse. --hold-out
      keeps records out of every fit (reported as held out): e.g. --hold-out stages=2
      --hold-out stages=4 for a device of one worker alone on the GPU (workers sharing it run
      slower; fit them apart with --hold-out stages=1).

Runs where Python 3 runs (no packages needed); `fit` needs pipefisher_sim (default
build/dev/sim/cli/pipefisher_sim, else build/release/..., else on PATH).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

# Parameters the flat model keeps (pipefisher_sim calibrate --keep).
FLAT_KEEP = [
    "classes.gemm.latency_s", "classes.gemm.half_efficiency_size", "classes.gemm.size_exponent",
    "classes.attention.latency_s", "classes.attention.half_efficiency_size",
    "classes.attention.size_exponent", "classes.memory.latency_s",
    "classes.memory.half_efficiency_size", "classes.memory.size_exponent",
    "classes.memory.beyond_cache_slowdown", "classes.memory.element_flop_s",
    "classes.memory.exponential_s=error_function_s", "classes.memory.exponential_s",
    "classes.memory.error_function_s", "classes.memory.random_number_s",
    "classes.factorization.latency_s",
]

UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
# A Google Benchmark console line of an aggregate: name, real (here: CUDA event) time and unit.
LINE = re.compile(r"^(BM_\w+)/([0-9/]+)(?:/manual_time)?_median\s+([0-9.]+) (ns|us|ms|s)\s")
# kernels::GemmPrecision's order; 3 (bf16-operands, an experiment) prices no record until it
# replaces bf16 (docs/cuda.md).
PRECISIONS = {0: "fp32", 1: "tf32", 2: "bf16"}


def bench_records(path):
    """gemm and chunk_forward_backward records from a benchmark program's console log."""
    records = []
    for line in open(path, errors="replace"):
        m = LINE.match(line.strip())
        if not m:
            continue
        name, args, value, unit = m.group(1), [int(a) for a in m.group(2).split("/") if a], \
            float(m.group(3)), m.group(4)
        seconds = value * UNITS[unit]
        if name == "BM_Gemm" and len(args) == 4:
            precision = PRECISIONS.get(args[3])
            if precision is None:
                continue
            records.append({"operation": "gemm", "set": "gemm", "case": f"gemm-{precision}",
                            "m": args[0], "n": args[1], "k": args[2], "precision": precision,
                            "seconds": seconds, "harness": "bench_cuda BM_Gemm, median"})
        elif name == "BM_BertStageForwardBackward" and len(args) == 1:
            precision = PRECISIONS.get(args[0])
            if precision is None:
                continue
            records.append({"operation": "chunk_forward_backward", "set": "stage",
                            "case": f"stage-{precision}", "model": "large", "seq_len": 128,
                            "micro_batch_size": 32, "layers": 3, "embeddings": False,
                            "head": False, "precision": precision, "storage_precision": "fp32",
                            "seconds": seconds,
                            "harness": "bench_model_cuda BM_BertStageForwardBackward, median"})
    return records


def train_records(name, path):
    data = json.load(open(path))
    defaults = data.get("defaults", {})
    records = []
    for record in data["measurements"]:
        merged = dict(defaults)
        merged.update(record)
        merged.setdefault("case", name)
        merged.setdefault("set", "train")
        records.append(merged)
    return records


def kernel_records(path):
    # bench_device_kernels: one case per kernel class (and product precision), so that `fit`
    # holds each class out in turn.
    records = []
    for record in train_records("", path):
        case = "kernels-" + record["operation"]
        if record["operation"] in ("gemm", "attention"):
            case += "-" + str(record.get("precision", "fp32"))
        record["case"] = case
        record["set"] = "kernels"
        records.append(record)
    return records


def cmd_records(args):
    records = []
    for path in args.kernels or []:
        if os.path.exists(path):
            records += kernel_records(path)
        else:
            print(f"records: {path} not found (bench_device_kernels failed or was skipped)",
                  file=sys.stderr)
    for path in args.bench or []:
        if os.path.exists(path):
            records += bench_records(path)
        else:
            print(f"records: {path} not found, skipped", file=sys.stderr)
    for item in args.train or []:
        name, _, path = item.partition("=")
        if not path:
            sys.exit(f"records: --train expects NAME=FILE.json, got {item!r}")
        if os.path.exists(path):
            records += train_records(name, path)
        else:
            print(f"records: {path} not found (the run failed or was skipped)", file=sys.stderr)
    if not records:
        sys.exit("records: nothing measured in the given files")
    provenance = dict(p.partition("=")[::2] for p in args.provenance or [])
    out = {"format_version": 1, "description": args.description or "", "provenance": provenance,
           "measurements": records}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    counts = {}
    for r in records:
        counts[r["case"]] = counts.get(r["case"], 0) + 1
    print(f"wrote {args.out}: {len(records)} records (" +
          ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")


def find_sim(explicit):
    if explicit:
        return explicit
    for candidate in ("build/dev/sim/cli/pipefisher_sim", "build/release/sim/cli/pipefisher_sim",
                      "build/gpu/sim/cli/pipefisher_sim"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("pipefisher_sim")
    if not found:
        sys.exit("fit: no pipefisher_sim (build it: ninja -C build/dev pipefisher_sim, or --sim)")
    return found


def calibrate(sim, measurements, start, hold_outs, keep, report, out=None, name=None):
    command = [sim, "calibrate", "--measurements", measurements, "--device", start,
               "--report", report]
    for rule in hold_outs:
        command += ["--hold-out", rule]
    for parameter in keep:
        command += ["--keep", parameter]
    if out:
        command += ["--out", out]
    if name:
        command += ["--name", name]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"fit: {' '.join(command)} failed:\n{result.stderr}")
    return result.stdout, json.load(open(report))["residuals"], command


def shell(command):
    return " ".join(c if re.fullmatch(r"[\w./=:*-]+", c) and "*" not in c else f"'{c}'"
                    for c in command)


def cmd_fit(args):
    sim = find_sim(args.sim)
    os.makedirs(args.out_dir, exist_ok=True)
    data = json.load(open(args.measurements))
    records = data["measurements"]
    defaults = data.get("defaults", {})
    stale = ["stale=true"] if any(r.get("stale") is True for r in records) else []
    stale += args.hold_out or []

    def as_text(value):  # as pipefisher_sim's --hold-out compares
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    def excluded(record):
        merged = {**defaults, **record}
        return any(rule.partition("=")[0] in merged and
                   as_text(merged[rule.partition("=")[0]]) == rule.partition("=")[2]
                   for rule in stale)
    keep = [] if args.free else FLAT_KEEP
    device = os.path.join(args.out_dir, "device.json")
    text, residuals, command = calibrate(sim, args.measurements, args.start, stale, keep,
                                         os.path.join(args.out_dir, "fit_all.json"), device,
                                         args.name)
    # The device file carries where it came from (pipefisher_sim ignores the field).
    fitted = json.load(open(device))
    provenance = data.get("provenance", {})
    fitted = {"name": fitted.pop("name"),
              "description": f"{'Every parameter' if args.free else 'The flat model'} fitted by "
                             f"scripts/gpu_calibration.py fit to {args.measurements} "
                             f"(start {args.start}; held out: {', '.join(stale) or 'none'})" +
                             "".join(f"; {k}: {v}" for k, v in provenance.items()),
              **fitted}
    with open(device, "w") as f:
        json.dump(fitted, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out_dir, "fit_all.txt"), "w") as f:
        f.write("$ " + shell(command) + "\n" + text)
    print("$ " + shell(command))
    print(text)

    groups = []
    for r in records:
        value = {**defaults, **r}.get(args.group)
        if value is not None and not excluded(r) and value not in groups:
            groups.append(value)
    rows = []
    for value in groups:
        safe = re.sub(r"[^\w.-]", "_", str(value))
        report = os.path.join(args.out_dir, f"held_out_{safe}.json")
        rule = f"{args.group}={value}"
        try:
            _, residuals, _ = calibrate(sim, args.measurements, args.start, stale + [rule], keep,
                                        report)
        except SystemExit as e:  # e.g. nothing left to fit
            print(f"held out {rule}: {e}", file=sys.stderr)
            continue
        for r, record in zip(residuals, records):
            if r["held_out"] and not excluded(record):
                rows.append((str(value), r["record"], r["measured_s"], r["predicted_s"],
                             r["relative_error"]))
    lines = [f"Each group held out in turn ({'all parameters' if args.free else 'flat model'};"
             f" {sim} calibrate ... --hold-out {args.group}=VALUE"
             f"{''.join(' --hold-out ' + rule for rule in stale)}"
             f"{' --keep ...' if keep else ''}):", "",
             "| held out | record | measured ms | predicted ms | error |", "|---|---|---|---|---|"]
    for value, label, measured, predicted, error in rows:
        lines.append(f"| {value} | {label} | {measured * 1e3:.4g} | {predicted * 1e3:.4g} | "
                     f"{100 * error:+.1f}% |")
    errors = sorted(abs(r[4]) for r in rows)
    if errors:
        median = errors[len(errors) // 2] if len(errors) % 2 else \
            0.5 * (errors[len(errors) // 2 - 1] + errors[len(errors) // 2])
        lines += ["", f"held-out records: {len(errors)}, median |error| {100 * median:.1f}%, "
                      f"worst {100 * errors[-1]:.1f}%, within 10%: "
                      f"{sum(e <= 0.10 for e in errors)}"]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out_dir, "held_out.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"device: {device}; tables: {args.out_dir}/fit_all.txt, {args.out_dir}/held_out.md")


def build_parser():
    # The list options extend: `--train A=a.json --train B=b.json` keeps both (argparse's default
    # for nargs="*" keeps only the last occurrence's values, which once merged one case of six).
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("records", help="merge a session's logs into one measurements file")
    r.add_argument("--out", required=True)
    many = {"nargs": "*", "action": "extend", "default": []}
    r.add_argument("--bench", **many, help="bench_cuda / bench_model_cuda console logs")
    r.add_argument("--train", **many, help="NAME=FILE.json from pipefisher_train "
                                           "--calibration-out")
    r.add_argument("--kernels", **many, help="bench_device_kernels measurements files")
    r.add_argument("--description")
    r.add_argument("--provenance", **many, help="KEY=VALUE (date, device, driver, commit)")
    r.set_defaults(run=cmd_records)
    f = sub.add_parser("fit", help="fit a device and check it on held-out groups")
    f.add_argument("measurements")
    f.add_argument("--out-dir", required=True)
    f.add_argument("--sim")
    f.add_argument("--start", default="h200", help="start device: preset or file (h200)")
    f.add_argument("--group", default="case", help="record field whose values are held out "
                                                   "in turn (case)")
    f.add_argument("--free", action="store_true", help="fit every parameter the records use")
    f.add_argument("--name", default="h200-pipefisher-runtime")
    f.add_argument("--hold-out", **many, help="FIELD=VALUE: out of every fit (e.g. stages=4)")
    f.set_defaults(run=cmd_fit)
    return parser


def main():
    args = build_parser().parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
