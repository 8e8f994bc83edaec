#!/usr/bin/env python3
"""PyTorch's Cholesky inverse on the CPU, the baseline of damped_inverse and the inversion chain
(bench_kfac_pieces' BM_InverseMonolithic / BM_InverseChain): cholesky_inverse(cholesky(a)) of a
Gram factor of 2n samples plus 1e-3 I, timed by the host clock, median of --repeats calls.

    python3 bench/torch_cholesky_inverse.py [--threads 1] [--orders 1024,2048] [--repeats 5]
"""
import argparse
import statistics
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--orders", default="1024,2048")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for order in (int(o) for o in args.orders.split(",")):
        samples = torch.randn(order, 2 * order)
        factor = samples @ samples.T / samples.shape[1] + 1e-3 * torch.eye(order)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            torch.cholesky_inverse(torch.linalg.cholesky(factor))
            times.append(time.perf_counter() - start)
        print(f"torch cholesky_inverse(cholesky)/{order} {statistics.median(times) * 1e3:.1f} ms "
              f"({args.threads} thread(s), torch {torch.__version__}, "
              f"MKL {torch.backends.mkl.is_available()})")


if __name__ == "__main__":
    main()
