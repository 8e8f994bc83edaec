#!/usr/bin/env python3
"""Schedule-file parity with PyTorch's torch.distributed.pipelining, checked by torch itself.

Optional: needs PyTorch 2.x (CPU is enough; `pip install torch`). The C++ test suite does not:
it reads the files this script writes, kept in tests/fixtures/torch_schedules.

    python3 scripts/torch_parity.py fixtures [OUT_DIR]
        Writes the fixtures from torch's own schedule classes, lowering and _dump_csv: each
        schedule as NAME.compute_only.csv (what torchtitan loads) and NAME.compute_comms.csv
        (torch's lowering: UNSHARD/RESHARD, SEND/RECV, WAIT_SEND_*, REDUCE_GRAD/WAIT_REDUCE_GRAD).
        OUT_DIR defaults to tests/fixtures/torch_schedules.

    python3 scripts/torch_parity.py check --sim build/release/sim/cli/pipefisher_sim
        1. regenerates the fixtures in a temporary folder and compares them byte for byte with
           tests/fixtures/torch_schedules (torch's writer has not changed under us);
        2. writes this project's schedules with `pipefisher_sim --csv` and `--csv-compute-only`,
           loads each in torch's _PipelineScheduleRuntime (_load_csv with format="compute_comms"
           and "compute_only"), runs torch's dry-run simulator on it (_simulate_comms_compute:
           no deadlock, every send received), and compares torch's own lowering of our
           compute-only file with our file with communication: the same actions in the same
           order, leaving out the per-stage actions (UNSHARD/RESHARD, which torch adds for FSDP,
           REDUCE_GRAD/WAIT_REDUCE_GRAD, no-ops with one replica), except that a receive may be
           posted at another position: torch's lowering spends a round on each per-stage action,
           so a peer's send (and the receive it posts) can come earlier in torch's order.
        Prints one line per check and exits 1 if any failed. Without torch it exits 2, or 77
        with --skip-without-torch (ctest's torch_parity test: skipped where torch is missing).
"""
import argparse
import contextlib
import filecmp
import io
import os
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "torch_schedules")

# (file name, schedule class name, ranks, stages per rank, micro-batches)
TORCH_CASES = [
    ("gpipe_p2_m1", "ScheduleLoopedBFS", 2, 1, 1),
    ("gpipe_p4_m8", "ScheduleLoopedBFS", 4, 1, 8),
    ("looped_bfs_p2_v2_m4", "ScheduleLoopedBFS", 2, 2, 4),
    ("interleaved_1f1b_p4_v2_m8", "ScheduleInterleaved1F1B", 4, 2, 8),
    ("interleaved_zb_p4_v2_m8", "ScheduleInterleavedZeroBubble", 4, 2, 8),
    ("zbv_p4_m8", "ScheduleZBVZeroBubble", 4, 2, 8),
    ("zbv_p2_m3", "ScheduleZBVZeroBubble", 2, 2, 3),
    ("dualpipev_p4_m8", "ScheduleDualPipeV", 4, 2, 8),
]
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")

# This project's schedules: (pipefisher_sim --schedule, p, m, v). Chimera is left out: its two
# pipelines hold every stage twice, which torch's format cannot say.
OUR_CASES = [
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved", 4, 8, 2),
    ("zbh1", 4, 8, 1),
    ("zbh2", 4, 8, 1),
    ("zbh1", 3, 6, 1),
    ("zbv", 4, 8, 2),
    ("zbv", 2, 3, 2),
]


def import_torch():
    warnings.filterwarnings("ignore")
    import torch  # noqa: F401  (an ImportError here says torch is missing)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return torch, dist, PipelineStage, schedules, FakeStore


def rank0_stages(ranks, per_rank, v_shaped):
    """Stage indices that rank 0 holds."""
    if v_shaped:
        return [0, 2 * ranks - 1]
    return [k * ranks for k in range(per_rank)]


@contextlib.contextmanager
def fake_group(dist, FakeStore, ranks):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_schedule(torch, PipelineStage, cls, ranks, per_rank, microbatches, v_shaped):
    stages = [
        PipelineStage(torch.nn.Linear(4, 4), index, ranks * per_rank, torch.device("cpu"))
        for index in rank0_stages(ranks, per_rank, v_shaped)
    ]
    return cls(stages, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())


def write_fixtures(out_dir):
    torch, dist, PipelineStage, S, FakeStore = import_torch()
    os.makedirs(out_dir, exist_ok=True)
    for name, cls_name, ranks, per_rank, microbatches in TORCH_CASES:
        with fake_group(dist, FakeStore, ranks):
            schedule = make_schedule(
                torch, PipelineStage, getattr(S, cls_name), ranks, per_rank, microbatches,
                cls_name in V_SHAPED)
            for fmt in ("compute_only", "compute_comms"):
                schedule._dump_csv(os.path.join(out_dir, f"{name}.{fmt}.csv"), format=fmt)
    return torch.__version__


def cells(path):
    with open(path, newline="") as f:
        return [[c for c in line.rstrip("\r\n").split(",") if c] for line in f]


def action_type(cell):
    digits = len(cell) - len(cell.lstrip("0123456789"))
    rest = cell[digits:]
    return rest.rstrip("0123456789") if rest and cell[0] != "(" else cell


def without(rows, types):
    return [[c for c in row if action_type(c) not in types] for row in rows]


def receives_moved(ours, theirs, receives):
    """How many receives of a row stand after a different number of other actions."""
    def positions(row):
        others, where = 0, {}
        for a in row:
            if action_type(a) in receives:
                where[a] = others
            else:
                others += 1
        return where
    mine, yours = positions(ours), positions(theirs)
    return sum(1 for a, at in mine.items() if yours.get(a) != at)


def stage_to_rank(rows):
    mapping = {}
    for rank, row in enumerate(rows):
        for cell in row:
            if cell[0] == "(":
                continue
            digits = len(cell) - len(cell.lstrip("0123456789"))
            mapping[int(cell[:digits])] = rank
    return mapping


def simulate(S, runtime, mapping, num_stages):
    """torch's dry-run simulator (no deadlock, every send received). It knows compute, SEND/RECV
    and WAIT_SEND only, so the per-stage actions (FSDP's UNSHARD/RESHARD, REDUCE_GRAD and its
    wait), which wait on nothing across ranks, are left out."""
    per_stage = {S.UNSHARD, S.RESHARD, S.REDUCE_GRAD, S.WAIT_REDUCE_GRAD}
    order = {rank: [a for a in actions if a is not None and a.computation_type not in per_stage]
             for rank, actions in runtime.pipeline_order_with_comms.items()}
    S._simulate_comms_compute(order, lambda s: mapping[s], num_stages)


def check(sim):
    torch, dist, PipelineStage, S, FakeStore = import_torch()
    failures = 0

    def report(ok, what):
        nonlocal failures
        failures += 0 if ok else 1
        print(("ok      " if ok else "FAILED  ") + what)

    with tempfile.TemporaryDirectory() as tmp:
        version = write_fixtures(os.path.join(tmp, "torch"))
        print(f"torch {version}")
        for name, *_ in TORCH_CASES:
            for fmt in ("compute_only", "compute_comms"):
                file = f"{name}.{fmt}.csv"
                same = filecmp.cmp(os.path.join(tmp, "torch", file), os.path.join(FIXTURES, file),
                                   shallow=False)
                report(same, f"fixture {file} is what torch {version} writes")

        for kind, p, m, v in OUR_CASES:
            label = f"{kind} p={p} m={m} v={v}"
            comms = os.path.join(tmp, f"{kind}_p{p}_m{m}.comms.csv")
            compute = os.path.join(tmp, f"{kind}_p{p}_m{m}.compute.csv")
            for path, extra in ((comms, []), (compute, ["--csv-compute-only"])):
                subprocess.run([sim, "--schedule", kind, "-p", str(p), "-m", str(m), "-v", str(v),
                                "--grid", "none", "--csv", path, *extra], check=True,
                               stdout=subprocess.DEVNULL)
            mapping = stage_to_rank(cells(compute))
            v_shaped = kind == "zbv"
            try:
                with fake_group(dist, FakeStore, p), contextlib.redirect_stdout(io.StringIO()):
                    runtime = make_schedule(torch, PipelineStage, S._PipelineScheduleRuntime, p, v, m,
                                            v_shaped)
                    runtime._load_csv(compute, format="compute_only")
                    torch_lowered = os.path.join(tmp, "torch_lowered.csv")
                    runtime._dump_csv(torch_lowered, format="compute_comms")
                    simulate(S, runtime, mapping, p * v)
                report(True, f"{label}: torch loads our compute_only file, lowers and simulates it")
            except Exception as error:  # torch's loaders raise several kinds
                report(False, f"{label}: torch refuses our compute_only file: {error!r}")
                continue
            try:
                with fake_group(dist, FakeStore, p), contextlib.redirect_stdout(io.StringIO()):
                    runtime = make_schedule(torch, PipelineStage, S._PipelineScheduleRuntime, p, v, m,
                                            v_shaped)
                    runtime.stage_index_to_group_rank = mapping
                    runtime._load_csv(comms, format="compute_comms")
                    simulate(S, runtime, mapping, p * v)
                report(True, f"{label}: torch loads our compute_comms file and simulates it")
            except Exception as error:
                report(False, f"{label}: torch refuses our compute_comms file: {error!r}")
                continue
            ours, theirs = cells(comms), cells(torch_lowered)
            per_stage = {"UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD"}
            receives = {"RECV_F", "RECV_B"}
            exact = without(ours, per_stage) == without(theirs, per_stage)
            same_order_but_receives = without(ours, per_stage | receives) == without(
                theirs, per_stage | receives)
            same_receives = all(
                sorted(a for a in o if action_type(a) in receives)
                == sorted(a for a in t if action_type(a) in receives)
                for o, t in zip(ours, theirs))
            moved = sum(receives_moved(o, t, receives)
                        for o, t in zip(without(ours, per_stage), without(theirs, per_stage)))
            report(same_order_but_receives and same_receives and len(ours) == len(theirs),
                   f"{label}: torch's lowering of our compute_only file is our compute_comms file"
                   + ("" if exact else f" but for where {moved} receive(s) are posted"))
    print(f"{failures} failed")
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fixtures = sub.add_parser("fixtures", help="write torch's schedule files")
    fixtures.add_argument("out_dir", nargs="?", default=FIXTURES)
    checker = sub.add_parser("check", help="check parity both ways")
    checker.add_argument("--sim", required=True, help="path of the pipefisher_sim binary")
    checker.add_argument("--skip-without-torch", action="store_true",
                         help="exit 77 (a skipped test to ctest) where torch is not installed")
    args = parser.parse_args()
    try:
        import_torch()
    except Exception as error:  # ImportError, or a torch that cannot load its libraries
        print(f"torch_parity.py: needs PyTorch 2.x ({error}); pip install torch", file=sys.stderr)
        return 77 if getattr(args, "skip_without_torch", False) else 2
    if args.command == "fixtures":
        print("torch", write_fixtures(args.out_dir), "wrote", args.out_dir)
        return 0
    if not os.access(args.sim, os.X_OK):
        print(f"torch_parity.py: --sim {args.sim} is not an executable", file=sys.stderr)
        return 2
    return check(args.sim)


if __name__ == "__main__":
    sys.exit(main())
