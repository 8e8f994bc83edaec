#!/usr/bin/env python3
"""Figures and tables of the convergence study (scripts/convergence_study.sh, docs/convergence.md).

  python3 scripts/convergence_plot.py RESULTS [--figures docs/figures] [--baseline GROUP]
                                      [--target LOSS] [--sim BUILD/sim/cli/pipefisher_sim]

Reads RESULTS/<run>/{metrics.jsonl,log.txt,command.txt}; a run's group is its name less the
"-s<seed>" suffix. Prints (markdown) the table of every run, the table per group with steps and
training time to the target held-out loss, and, with --sim, the projection to BERT-Base/Large on
the simulator's GPU presets. Draws held-out loss against steps and against training time, and the
training loss against steps, with a band from the lowest to the highest seed (PNG, small).

The target is fixed by a rule, before any K-FAC run is looked at: the highest final held-out loss
among the seeds of the baseline (LAMB's best sweep group), so that every LAMB seed reaches it
within its budget, unless --target is given.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys


def load_run(directory):
    steps, evals, kfac = [], [], []
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            kind = record.get("kind", "step")
            {"step": steps, "eval": evals, "kfac": kfac}[kind].append(record)
    log = open(os.path.join(directory, "log.txt")).read()
    command = open(os.path.join(directory, "command.txt")).read().strip()
    run = {"steps": steps, "evals": evals, "kfac": kfac, "log": log, "command": command}
    m = re.search(r"PipeFisher: K-FAC refresh every (\d+) step\(s\); predicted utilization "
                  r"([\d.]+)% -> ([\d.]+)%, step time ([+-][\d.]+)%", log)
    if m:
        run["k"] = int(m.group(1))
        run["predicted"] = (float(m.group(2)), float(m.group(3)), float(m.group(4)))
    m = re.search(r"measured over steps \S+: ([\d.]+) s/step, utilization ([\d.]+)%"
                  r"(?: \(([\d.]+)% with K-FAC\))?", log)
    if m:
        run["measured_step_s"] = float(m.group(1))
        run["measured_util"] = float(m.group(2))
        run["measured_util_kfac"] = float(m.group(3)) if m.group(3) else None
    m = re.search(r"per rank \(compute \+ K-FAC of the window\):(.*)", log)
    if m:
        # " 0: 58.9% + 19.5%, 1: 61.4%": compute and (where any ran) K-FAC share of the window
        run["per_rank"] = [(float(c), float(k) if k else 0.0) for c, k in
                           re.findall(r"\d+: ([\d.]+)%(?: \+ ([\d.]+)%)?", m.group(1))]
    m = re.search(r"simulator replay of these durations: ([\d.]+) s/step \(([+-][\d.]+)%", log)
    if m:
        run["replay_error"] = float(m.group(2))
    return run


def group_of(name):
    return re.sub(r"-s\d+$", "", name)


def seed_of(name):
    m = re.search(r"-s(\d+)$", name)
    return int(m.group(1)) if m else 0


def median_step_time(run):
    times = [r["step_time_s"] for r in run["steps"][1:]] or [r["step_time_s"] for r in run["steps"]]
    return statistics.median(times)


def reach(run, target):
    """(step, training seconds) of the first evaluation at or below the target, else None."""
    for e in run["evals"]:
        if e["eval_loss"] <= target:
            return e["step"], e["train_time_s"]
    return None


def reach_interpolated(run, target):
    """The step at which the held-out loss crosses the target, linear between the evaluations
    around the crossing (evaluations are EVAL_EVERY steps apart), else None."""
    previous = None
    for e in run["evals"]:
        if e["eval_loss"] <= target:
            if previous is None or previous["eval_loss"] == e["eval_loss"]:
                return float(e["step"])
            f = (previous["eval_loss"] - target) / (previous["eval_loss"] - e["eval_loss"])
            return previous["step"] + f * (e["step"] - previous["step"])
        previous = e
    return None


def warmup_of(group):
    """(warm-up steps, the group of K-FAC k = 1 with the same learning rate) of a group whose
    runs refreshed K-FAC every step for their first steps (pipefisher_train --kfac-warmup-steps),
    else None."""
    m = re.match(r"^kfac\d+-warmup(\d+)-lamb-lr(\S+)$", group)
    return (int(m.group(1)), f"kfac1-lamb-lr{m.group(2)}") if m else None


def training_time(steps, step_time, warmup=None):
    """Seconds of `steps` steps at `step_time`, of which the warm-up's (steps, step time) at
    its own."""
    if warmup is None:
        return steps * step_time
    warm_steps, warm_time = warmup
    return min(steps, warm_steps) * warm_time + max(0.0, steps - warm_steps) * step_time


def mean_std(values):
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def label_of(group):
    g = group
    g = re.sub(r"^kfac(\d+)-warmup(\d+)-lamb-lr(\S+)$",
               r"K-FAC k=\1 after \2 steps of k=1 + LAMB lr \3", g)
    g = re.sub(r"^kfac(\d+)-lamb-lr(\S+?)-d(\S+)$", r"K-FAC k=\1 + LAMB lr \2, damping \3", g)
    g = re.sub(r"^kfac(\d+)-lamb-lr(\S+)$", r"K-FAC k=\1 + LAMB lr \2", g)
    g = re.sub(r"^kfac-lamb-lr(\S+)$", r"K-FAC pass's k + LAMB lr \1", g)
    g = re.sub(r"^kfac-sgd-lr(\S+)$", r"K-FAC k=1 + SGD lr \1", g)
    g = re.sub(r"^lamb-lr(\S+?)-w(\S+)$", r"LAMB lr \1, warm-up \2", g)
    g = re.sub(r"^lamb-lr(\S+)$", r"LAMB lr \1", g)
    return g


def band_plot(ax, runs, x_key, y_of, label, color, linestyle="-"):
    """Mean over seeds with a min..max band, on the x values all seeds share."""
    import numpy as np
    series = []
    for run in runs:
        points = y_of(run)
        series.append(points)
    length = min(len(s) for s in series)
    if length == 0:
        return
    xs = np.array([[p[0] for p in s[:length]] for s in series])
    ys = np.array([[p[1] for p in s[:length]] for s in series])
    x = xs.mean(axis=0)
    ax.plot(x, ys.mean(axis=0), label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})",
            color=color, linewidth=1.4, linestyle=linestyle)
    if len(runs) > 1:
        ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.2, linewidth=0)


def smooth(values, window=5):
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def draw(groups, order, target, figures):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(figures, exist_ok=True)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf",
              "#7f7f7f", "#bcbd22", "#e377c2"]
    plots = [
        ("convergence_eval_vs_steps.png", "step", "held-out loss (MLM + NSP)",
         lambda r: [(e["step"], e["eval_loss"]) for e in r["evals"]]),
        ("convergence_eval_vs_time.png", "training time (s, summed measured step times)",
         "held-out loss (MLM + NSP)",
         lambda r: [(e["train_time_s"], e["eval_loss"]) for e in r["evals"]]),
        ("convergence_train_vs_steps.png", "step", "training loss (MLM + NSP), 5-step mean",
         lambda r: list(zip([s["step"] for s in r["steps"]],
                            smooth([s["loss"] for s in r["steps"]])))),
    ]
    written = []
    for filename, xlabel, ylabel, series in plots:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
        for i, group in enumerate(order):
            # past ten groups the colours repeat: a dashed, then dotted line tells them apart
            band_plot(ax, groups[group], None, series, label_of(group), colors[i % len(colors)],
                      ["-", "--", ":"][(i // len(colors)) % 3])
        if target is not None and "train" not in filename:
            ax.axhline(target, color="black", linestyle="--", linewidth=0.8,
                       label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(figures, filename)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def simulate(sim, model, device, stages, microbatches, mbs, k):
    """(step time without K-FAC, with K-FAC at refresh k or the pass's own) from pipefisher_sim."""
    out = "/tmp/convergence_sim_report.json"
    args = [sim, "--schedule", "1f1b", "--stages", str(stages), "--microbatches", str(microbatches),
            "--model", model, "--device", device, "--seq-len", "128", "--micro-batch-size",
            str(mbs), "--kfac", "--report", out]
    if k:
        args += ["--kfac-refresh", str(k)]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    report = json.load(open(out))
    return report["step_time_s"], report["with_kfac"]["step_time_s"], report["kfac"]["refresh_steps"]


def predicted_per_worker(sim, run_dir, k, stages=2, microbatches=8):
    """pipefisher_sim on the run's own measured profile at the run's k: per worker
    (utilization before, after) filling."""
    out = os.path.join("/tmp", "convergence_util_report.json")
    subprocess.run([sim, "--schedule", "1f1b", "--stages", str(stages), "--microbatches",
                    str(microbatches), "--profile", os.path.join(run_dir, "profile.json"),
                    "--kfac", "--kfac-refresh", str(k), "--report", out],
                   check=True, stdout=subprocess.DEVNULL)
    report = json.load(open(out))
    return [(w["utilization_before"] * 100, w["utilization_after"] * 100)
            for w in report["kfac"]["workers"]], report


def utilization(run, run_dir, before_run, sim, figures):
    """Table and figure: per worker, measured utilization before filling (the LAMB run of the
    same learning rate and seed: no K-FAC) and after (the traced K-FAC run: compute + K-FAC),
    beside the simulator's prediction from the traced run's own measured profile."""
    after = run.get("per_rank")
    if not after or not re.search(r"-k(\d+)$", run["name"]):
        return
    before = before_run.get("per_rank") if before_run else None
    if not before or len(before) != len(after):
        before = [(c, 0.0) for c, _ in after]  # no LAMB run: the K-FAC run's compute share
        before_label = f"{run['name']}'s compute share"
    else:
        before_label = before_run["name"]
    measured = [(b[0], a[0] + a[1]) for b, a in zip(before, after)]
    k = run.get("k") or int(re.search(r"-k(\d+)$", run["name"]).group(1))
    predicted = None
    if sim and os.path.isfile(os.path.join(run_dir, "profile.json")):
        predicted, report = predicted_per_worker(sim, run_dir, k)
    print(f"\nUtilization per worker (busy share of the step, over steps 2-end): before filling "
          f"measured in {before_label}, after in {run['name']} (k = {k}), predicted by the "
          f"simulator from {run['name']}'s own measured profile at the same k:\n")
    print("| worker | measured before | measured after | predicted before | predicted after |")
    print("|---|---|---|---|---|")
    for w, (m_before, m_after) in enumerate(measured):
        pred = predicted[w] if predicted and w < len(predicted) else None
        print(f"| {w} | {m_before:.1f}% | {m_after:.1f}% | "
              f"{f'{pred[0]:.1f}%' if pred else '-'} | {f'{pred[1]:.1f}%' if pred else '-'} |")
    if predicted:
        print(f"\nPredicted step time {report['step_time_s']:.3f} s -> "
              f"{report['kfac']['step_time_after_s']:.3f}"
              f" s per step with K-FAC; measured {run.get('measured_step_s', float('nan')):.3f} s.")
    if not figures:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    workers = list(range(len(measured)))
    width = 0.2
    bars = [("measured before (LAMB)", [m[0] for m in measured], "#9ecae1"),
            ("measured after (K-FAC in bubbles)", [m[1] for m in measured], "#1f77b4")]
    if predicted:
        bars += [("predicted before", [p[0] for p in predicted], "#fdae6b"),
                 ("predicted after", [p[1] for p in predicted], "#e6550d")]
    for i, (label, values, color) in enumerate(bars):
        xs = [w + (i - (len(bars) - 1) / 2) * width for w in workers]
        ax.bar(xs, values, width, label=label, color=color)
        for x, v in zip(xs, values):
            ax.text(x, v + 0.8, f"{v:.0f}", ha="center", fontsize=6)
    ax.set_xticks(workers, [f"worker {w}" for w in workers])
    ax.set_ylabel("utilization (% of step time busy)")
    ax.set_ylim(0, 130)
    ax.set_title(f"1F1B p = {len(workers)}, K-FAC refresh every {k} steps", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    os.makedirs(figures, exist_ok=True)
    path = os.path.join(figures, "convergence_utilization.png")
    fig.savefig(path)
    plt.close(fig)
    print(f"\nwrote {path}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--figures", default=None)
    parser.add_argument("--baseline", default=None, help="group whose final loss is the target")
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--sim", default=None, help="pipefisher_sim, for the projection")
    parser.add_argument("--step-time", action="append", default=[], metavar="GROUP=SECONDS",
                        help="a group's step time measured side by side with the baseline's "
                             "(bench_runtime), used for time to target instead of the runs' own "
                             "median (runs made at different machine loads are not comparable)")
    args = parser.parse_args()

    runs, traced = {}, {}
    for name in sorted(os.listdir(args.results)):
        d = os.path.join(args.results, name)
        if os.path.isfile(os.path.join(d, "done")):
            # The short traced run of the utilization phase is not a convergence run.
            (traced if name.startswith("utilization-") else runs)[name] = load_run(d)
    if not runs:
        sys.exit("no finished runs in " + args.results)
    groups = {}
    for name, run in runs.items():
        run["name"] = name
        groups.setdefault(group_of(name), []).append(run)

    lamb_groups = [g for g in groups if g.startswith("lamb-")]
    baseline = args.baseline
    if baseline is None and lamb_groups:
        # The LAMB group with the most seeds (the sweep's winner), then the lowest final loss.
        baseline = min(lamb_groups, key=lambda g: (-len(groups[g]), statistics.mean(
            r["evals"][-1]["eval_loss"] for r in groups[g])))
    target = args.target
    if target is None and baseline:
        # The highest final held-out loss among the baseline's seeds: every seed of the
        # baseline reaches it within its budget.
        target = max(r["evals"][-1]["eval_loss"] for r in groups[baseline])

    print(f"Target held-out loss: {target:.4f} (the highest final held-out loss among the seeds "
          f"of {baseline}, or --target)\n")
    print("| run | k | final held-out loss | MLM acc | NSP acc | final train loss (5-step mean) "
          "| steps to target | training s to target | median step s | command |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        last = run["evals"][-1]
        hit = reach(run, target)
        train_tail = statistics.mean(s["loss"] for s in run["steps"][-5:])
        print(f"| {name} | {run.get('k', '-')} | {last['eval_loss']:.4f} | "
              f"{last['eval_mlm_accuracy']:.3f} | {last['eval_nsp_accuracy']:.3f} | "
              f"{train_tail:.4f} | {hit[0] if hit else 'not reached'} | "
              f"{f'{hit[1]:.1f}' if hit else '-'} | {median_step_time(run):.3f} | "
              f"`{run['command']}` |")

    order = sorted(groups, key=lambda g: (not g.startswith("lamb"), g))
    bench_times = {k: float(v) for k, v in (a.split("=") for a in args.step_time)}
    summary = {}
    for group in order:
        members = groups[group]
        reached = [h for h in (reach(r, target) for r in members) if h]
        summary[group] = {
            "finals": [r["evals"][-1]["eval_loss"] for r in members],
            "accs": [r["evals"][-1]["eval_mlm_accuracy"] for r in members],
            "steps": statistics.mean(h[0] for h in reached) if reached else None,
        "steps_interpolated": statistics.mean(reach_interpolated(r, target) for r in members)
        if len(reached) == len(members) else None,
            "step_time": bench_times.get(group,
                                         statistics.median(median_step_time(r) for r in members)),
            "own_step_time": statistics.median(median_step_time(r) for r in members),
            "reached": len(reached), "seeds": len(members)}
    for group, s in summary.items():  # a warm-up's steps at the k = 1 group's step time
        w = warmup_of(group)
        s["warmup"] = (w[0], summary[w[1]]["step_time"]) if w and w[1] in summary else None
    base = summary.get(baseline)
    print("\n| group | seeds | final held-out loss (mean ± sd) | MLM acc | reached target "
          "| steps to target (mean) | interpolated | runs' median step s | step s used "
          "| steps x step s | time to target / baseline's | interpolated |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for group, s in summary.items():
        m, sd = mean_std(s["finals"])
        if s["reached"] < s["seeds"]:
            rel = f"not reached by {s['seeds'] - s['reached']} seed(s)"
        elif bench_times and group not in bench_times:
            rel = "no side-by-side step time"
        elif base and base["steps"] and s["steps"]:
            ratio = training_time(s["steps"], s["step_time"], s["warmup"]) / (
                base["steps"] * base["step_time"])
            rel = f"{ratio:.2f}"
        else:
            rel = "-"
        rel_i = "-"
        if rel[0].isdigit() and base["steps_interpolated"] and s["steps_interpolated"]:
            ratio = training_time(s["steps_interpolated"], s["step_time"], s["warmup"]) / (
                base["steps_interpolated"] * base["step_time"])
            rel_i = f"{ratio:.2f}"
        steps = f"{s['steps']:.1f}" if s["steps"] else "-"
        steps_i = f"{s['steps_interpolated']:.1f}" if s["steps_interpolated"] else "-"
        product = (f"{training_time(s['steps'], s['step_time'], s['warmup']):.1f}"
                   if s["steps"] else "-")
        print(f"| {label_of(group)} | {s['seeds']} | {m:.4f} ± {sd:.4f} | "
              f"{statistics.mean(s['accs']):.3f} | {s['reached']}/{s['seeds']} | {steps} | "
              f"{steps_i} | {s['own_step_time']:.3f} | {s['step_time']:.3f}"
              f"{' (side by side)' if group in bench_times else ''} | {product} | {rel} | "
              f"{rel_i} |")

    kfac_runs = [r for r in runs.values() if r["kfac"]]
    if kfac_runs:
        print("\nK-FAC statistics at the end of each K-FAC run:\n")
        print("| run | k | refreshes | pi (min / median / max) | damping A / B (mean) "
              "| Cholesky fallbacks | predicted util before -> after, step time | "
              "measured util before -> with K-FAC |")
        print("|---|---|---|---|---|---|---|---|")
        for r in kfac_runs:
            st = r["kfac"][-1]
            pred = r.get("predicted")
            print(f"| {r['name']} | {st['refresh_steps']} | {st['refreshes_min']} | "
                  f"{st.get('pi_min', 0):.3g} / {st.get('pi_median', 0):.3g} / "
                  f"{st.get('pi_max', 0):.3g} | {st.get('damping_a_mean', 0):.3g} / "
                  f"{st.get('damping_b_mean', 0):.3g} | {st['cholesky_fallbacks']} | "
                  f"{f'{pred[0]}% -> {pred[1]}%, {pred[2]:+}%' if pred else '-'} | "
                  f"{r.get('measured_util', '-')}% -> {r.get('measured_util_kfac', '-')}% |")

    if args.sim and base and base["steps"]:
        print("\nProjection (measured steps to target x pipefisher_sim step time, 1F1B p = 4, "
              "m = 8, micro-batch 32, seq 128, bf16):\n")
        print("| K-FAC group | model | device | k | sim step s LAMB | sim step s K-FAC "
              "| step-time ratio | steps ratio | time-to-target ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for group, s in summary.items():
            if not group.startswith("kfac") or not s["steps"] or s["reached"] < s["seeds"]:
                continue
            fixed = re.match(r"kfac(\d+)-", group)
            fixed_k = int(fixed.group(1)) if fixed else 1 if group.startswith("kfac-sgd") else 0
            for model in ("base", "large"):
                for device in ("h100", "a100"):
                    t0, t1, k = simulate(args.sim, model, device, 4, 8, 32, fixed_k)
                    steps_ratio = s["steps"] / base["steps"]
                    # A warm-up's steps at the simulated k = 1 step, the rest at k.
                    warm = (s["warmup"][0], simulate(args.sim, model, device, 4, 8, 32, 1)[1]) \
                        if s["warmup"] else None
                    time_ratio = training_time(s["steps"], t1, warm) / (base["steps"] * t0)
                    print(f"| {label_of(group)} | {model} | {device} | {k} | {t0 * 1e3:.2f} ms | "
                          f"{t1 * 1e3:.2f} ms | {t1 / t0:.3f} | {steps_ratio:.2f} | "
                          f"{time_ratio:.2f} |")

    for name, run in traced.items():
        run["name"] = name
        lr = re.search(r"-lr(\S+?)-k\d+$", name)
        before_run = runs.get(f"lamb-lr{lr.group(1)}-s1") if lr else None
        if before_run:
            before_run["name"] = f"lamb-lr{lr.group(1)}-s1"
        utilization(run, os.path.join(args.results, name), before_run, args.sim, args.figures)

    if args.figures:
        for path in draw(groups, order, target, args.figures):
            print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
