#!/usr/bin/env python3
"""K-FAC's three CPU operations in PyTorch, the baseline of bench_kfac's BM_Curvature,
BM_InvertCholesky and BM_Precondition at the same sizes: the curvature factor x^T x / T of T token
rows (one product: PyTorch has no SYRK), the damped Cholesky inverse cholesky_inverse(cholesky(F +
1e-3 I)) of a Gram factor of 256 rows plus a ramp on the diagonal (as bench_kfac's random_factor),
and the preconditioning B^-1 G A^-1. fp32, timed by the host clock, median of --repeats calls after
one warm-up call.

    python3 bench/torch_kfac_ops.py [--threads 1] [--repeats 5] [--only curvature,inverse,precondition]
"""
import argparse
import statistics
import time

import torch


def median_ms(repeats, body):
    body()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        body()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def random_factor(dim):
    x = torch.randn(256, dim)
    return x.T @ x / 256 + torch.diag(torch.linspace(0.01, 1.0, dim))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="curvature,inverse,precondition")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    only = set(args.only.split(","))
    print(f"torch {torch.__version__}, MKL {torch.backends.mkl.is_available()}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    if "curvature" in only:
        for dim, tokens in ((1024, 4096), (4096, 4096)):
            x = torch.randn(tokens, dim)
            ms = median_ms(args.repeats, lambda: torch.mm(x.T, x).mul_(1.0 / tokens))
            print(f"curvature/{dim}/{tokens} {ms:.1f} ms")
    if "inverse" in only:
        for dim in (1024, 4096):
            damped = random_factor(dim) + 1e-3 * torch.eye(dim)
            ms = median_ms(args.repeats,
                           lambda: torch.cholesky_inverse(torch.linalg.cholesky(damped)))
            print(f"inverse/{dim} {ms:.1f} ms")
    if "precondition" in only:
        for d_out, d_in in ((1024, 1024), (4096, 1024)):
            a_inv, b_inv = random_factor(d_in), random_factor(d_out)
            grad = torch.randn(d_out, d_in)
            ms = median_ms(args.repeats, lambda: b_inv @ grad @ a_inv)
            print(f"precondition/{d_out}/{d_in} {ms:.1f} ms")


if __name__ == "__main__":
    main()
