#!/usr/bin/env python3
"""scripts/gpu_calibration.py: repeated list options keep every occurrence's values, and
bench_device_kernels' records are tagged by kernel class.

`records --train A=a.json --train B=b.json` once merged only B's records (argparse's nargs="*"
stores the last occurrence), and `fit --hold-out stages=2 --hold-out stages=4` held out only
stages=4. Run by CTest (GpuCalibrationScript) from the repository root, or by hand.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_calibration.py")
spec = importlib.util.spec_from_file_location("gpu_calibration", SCRIPT)
gpu_calibration = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_calibration)


def calibration_file(path, seconds):
    # The shape of pipefisher_train --calibration-out: no "case", no "set".
    records = [{"operation": "chunk_forward", "layers": 24, "seconds": seconds},
               {"operation": "optimizer_step", "params": 1000.0, "seconds": seconds / 2}]
    with open(path, "w") as f:
        json.dump({"format_version": 1, "measurements": records}, f)


class RepeatedOptions(unittest.TestCase):
    def test_parser_extends_every_list_option(self):
        parse = gpu_calibration.build_parser().parse_args
        args = parse(["records", "--out", "m.json", "--train", "a=a.json", "--train", "b=b.json",
                      "c=c.json", "--bench", "x.log", "--bench", "y.log", "--provenance", "k=1",
                      "--provenance", "l=2"])
        self.assertEqual(args.train, ["a=a.json", "b=b.json", "c=c.json"])
        self.assertEqual(args.bench, ["x.log", "y.log"])
        self.assertEqual(args.provenance, ["k=1", "l=2"])
        args = parse(["fit", "m.json", "--out-dir", "d", "--hold-out", "stages=2", "--hold-out",
                      "stages=4"])
        self.assertEqual(args.hold_out, ["stages=2", "stages=4"])
        self.assertEqual(parse(["fit", "m.json", "--out-dir", "d"]).hold_out, [])

    def test_records_merges_every_train_file(self):
        with tempfile.TemporaryDirectory() as d:
            inputs = []
            for name, seconds in (("one", 0.01), ("two", 0.02), ("three", 0.03)):
                path = os.path.join(d, f"{name}.json")
                calibration_file(path, seconds)
                inputs.append(f"{name}={path}")
            out = os.path.join(d, "merged.json")
            # Two cases after one --train, the third after another: both forms at once.
            result = subprocess.run([sys.executable, SCRIPT, "records", "--out", out,
                                     "--train", inputs[0], inputs[1], "--train", inputs[2],
                                     "--provenance", "date=x", "--provenance", "device=y"],
                                    capture_output=True, text=True)
            self.assertEqual(result.returncode, 0, result.stderr)
            merged = json.load(open(out))
            cases = [r["case"] for r in merged["measurements"]]
            self.assertEqual(cases, ["one", "one", "two", "two", "three", "three"])
            self.assertTrue(all(r["set"] == "train" for r in merged["measurements"]))
            self.assertEqual(merged["provenance"], {"date": "x", "device": "y"})

    def test_records_tags_device_kernels_by_class(self):
        # bench_device_kernels' records: one case per class (and product precision), so that
        # `fit --group case` holds each class out in turn; defaults merged in.
        with tempfile.TemporaryDirectory() as d:
            kernels = os.path.join(d, "kernels.json")
            with open(kernels, "w") as f:
                json.dump({"format_version": 1, "defaults": {"precision": "fp32"},
                           "measurements": [
                               {"operation": "gemm", "m": 8, "n": 8, "k": 8, "precision": "tf32",
                                "count": 10, "seconds": 1e-4},
                               {"operation": "gemm", "m": 8, "n": 8, "k": 8, "seconds": 2e-4},
                               {"operation": "memory", "bytes": 96.0, "seconds": 1e-5},
                               {"operation": "cholesky_inverse", "order": 16, "seconds": 1e-3}]},
                          f)
            out = os.path.join(d, "merged.json")
            result = subprocess.run([sys.executable, SCRIPT, "records", "--out", out,
                                     "--kernels", kernels, os.path.join(d, "missing.json")],
                                    capture_output=True, text=True)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("missing.json not found", result.stderr)
            merged = json.load(open(out))["measurements"]
            self.assertEqual([r["case"] for r in merged],
                             ["kernels-gemm-tf32", "kernels-gemm-fp32", "kernels-memory",
                              "kernels-cholesky_inverse"])
            self.assertTrue(all(r["set"] == "kernels" for r in merged))
            self.assertEqual(merged[0]["count"], 10)


if __name__ == "__main__":
    unittest.main()
