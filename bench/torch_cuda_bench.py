#!/usr/bin/env python3
"""The work of bench_cuda / bench_kfac_cuda in PyTorch on the same GPU, timed with CUDA events
(median of 15 repetitions of `inner` calls): GEMMs of BERT-Large's shapes (fp32, TF32, bf16),
attention forward+backward written as Hugging Face's BERT eager path (and SDPA), LayerNorm
forward+backward, K-FAC factor inversion (Cholesky + cholesky_inverse) and curvature (x^T x).

    python3 bench/torch_cuda_bench.py [--only gemm,attention,layernorm,kfac,layer]
"""
import argparse
import math
import statistics

import torch
import torch.nn.functional as F


def time_cuda(fn, inner=10, reps=15, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner * 1e3)  # microseconds
    return statistics.median(times)


def report(name, us, flops=None, bytes_=None):
    extra = ""
    if flops:
        extra += f"  {flops / us * 1e-6:8.1f} TFLOP/s"
    if bytes_:
        extra += f"  {bytes_ / us * 1e-3:8.1f} GB/s"
    print(f"{name:<52} {us:10.1f} us{extra}", flush=True)


def set_tf32(on):
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def bench_gemm():
    for m, n, k in [(4096, 3072, 1024), (4096, 4096, 1024), (4096, 1024, 4096)]:
        for mode in ["fp32", "tf32", "bf16"]:
            dtype = torch.bfloat16 if mode == "bf16" else torch.float32
            set_tf32(mode == "tf32")
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(n, k, device="cuda", dtype=dtype)
            us = time_cuda(lambda: a @ b.t())
            report(f"torch gemm {m}x{n}x{k} {mode}", us, flops=2.0 * m * n * k)
    set_tf32(False)


def hf_attention(q, k, v, mask, p):
    # q, k, v: [B, N, S, D]; mask: [B, 1, 1, S] additive (0 / -10000), as BertSelfAttention.
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=p, training=True)
    return probs @ v


def bench_attention():
    for batch, seq in [(32, 128), (8, 512)]:
        heads, d = 16, 64
        flops = 6.0 * 2.0 * batch * heads * seq * seq * d
        for mode in ["fp32", "tf32", "bf16"]:
            set_tf32(mode == "tf32")
            dtype = torch.bfloat16 if mode == "bf16" else torch.float32
            qkv = torch.randn(batch, seq, 3, heads, d, device="cuda", dtype=dtype, requires_grad=True)
            mask = torch.zeros(batch, 1, 1, seq, device="cuda", dtype=dtype)
            grad = torch.randn(batch, heads, seq, d, device="cuda", dtype=dtype)

            def step():
                q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
                out = hf_attention(q, k, v, mask, 0.1)
                out.backward(grad)

            report(f"torch attention fwd+bwd B={batch} S={seq} {mode} (HF eager)",
                   time_cuda(step, inner=5), flops=flops)

            def sdpa():
                q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
                out.backward(grad)

            report(f"torch attention fwd+bwd B={batch} S={seq} {mode} (SDPA)",
                   time_cuda(sdpa, inner=5), flops=flops)
    set_tf32(False)


def bench_layernorm():
    rows, cols = 4096, 1024
    x = torch.randn(rows, cols, device="cuda", requires_grad=True)
    ln = torch.nn.LayerNorm(cols, eps=1e-12).cuda()
    dy = torch.randn(rows, cols, device="cuda")

    def step():
        y = ln(x)
        y.backward(dy)

    report(f"torch layernorm fwd+bwd {rows}x{cols} fp32", time_cuda(step), bytes_=7.0 * rows * cols * 4)


def random_factor(dim):
    x = torch.randn(256, dim, device="cuda")
    return x.t() @ x / 256 + torch.diag(torch.linspace(0.01, 1.0, dim, device="cuda"))


def bench_kfac():
    for dim in [768, 1024, 3072, 4096]:
        factor = random_factor(dim)
        damping = 1e-3

        def cholesky_inverse():
            damped = factor + damping * torch.eye(dim, device="cuda")
            chol = torch.linalg.cholesky(damped)
            return torch.cholesky_inverse(chol)

        report(f"torch kfac inverse cholesky d={dim}", time_cuda(cholesky_inverse, inner=3))

        def eigh_inverse():
            values, vectors = torch.linalg.eigh(factor)
            values = values.clamp(min=0) + damping
            return (vectors / values) @ vectors.t()

        report(f"torch kfac inverse eigh d={dim}", time_cuda(eigh_inverse, inner=1, reps=5))
        tokens = torch.randn(4096, dim, device="cuda")
        acc = torch.zeros(dim, dim, device="cuda")
        set_tf32(False)
        report(f"torch kfac curvature x^T x T=4096 d={dim} fp32",
               time_cuda(lambda: acc.addmm_(tokens.t(), tokens, alpha=1.0 / 4096)),
               flops=2.0 * 4096 * dim * dim)
    for d_out, d_in in [(1024, 1024), (4096, 1024)]:
        a_inv = torch.randn(d_in, d_in, device="cuda")
        b_inv = torch.randn(d_out, d_out, device="cuda")
        g = torch.randn(d_out, d_in, device="cuda")
        report(f"torch kfac precondition {d_out}x{d_in} fp32", time_cuda(lambda: b_inv @ g @ a_inv),
               flops=2.0 * d_out * d_in * (d_out + d_in))


def bench_optim():
    # One BERT-Large encoder layer's parameters (12.6 M values), torch's fused AdamW and foreach SGD.
    sizes = [3 * 1024 * 1024, 3 * 1024, 1024 * 1024, 1024, 1024, 1024,
             4096 * 1024, 4096, 1024 * 4096, 1024, 1024, 1024]
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
    report("torch optimizer step AdamW (fused) BERT-Large layer", time_cuda(adamw.step))
    sgd = torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)
    report("torch optimizer step SGD momentum (foreach) BERT-Large layer", time_cuda(sgd.step))


def bench_layer():
    # One BERT-Large encoder layer (hidden 1024, 16 heads, FFN 4096), B=32, S=128, dropout 0.1.
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, h=1024, heads=16, inter=4096):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(h, 3 * h)
            self.o = nn.Linear(h, h)
            self.ln1 = nn.LayerNorm(h, eps=1e-12)
            self.fi = nn.Linear(h, inter)
            self.fo = nn.Linear(inter, h)
            self.ln2 = nn.LayerNorm(h, eps=1e-12)

        def forward(self, x, mask):
            b, s, h = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
            ctx = hf_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, 0.1)
            ctx = ctx.transpose(1, 2).reshape(b, s, h)
            x = self.ln1(x + F.dropout(self.o(ctx), 0.1))
            return self.ln2(x + F.dropout(self.fo(F.gelu(self.fi(x))), 0.1))

    layer = Layer().cuda()
    b, s = 32, 128
    x = torch.randn(b, s, 1024, device="cuda", requires_grad=True)
    mask = torch.zeros(b, 1, 1, s, device="cuda")
    dy = torch.randn(b, s, 1024, device="cuda")
    flops = 3 * (2 * b * s * (1024 * 3072 + 1024 * 1024 + 2 * 1024 * 4096) + 4 * b * 16 * s * s * 64)
    for mode in ["fp32", "tf32", "bf16"]:
        set_tf32(mode == "tf32")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
                y = layer(x, mask)
            y.backward(dy)

        report(f"torch BERT-Large layer fwd+bwd B=32 S=128 {mode} (eager)", time_cuda(step, inner=3),
               flops=flops)
    set_tf32(False)
    # The second baseline: the same layer through torch.compile, bf16 autocast.
    try:
        compiled = torch.compile(layer)

        def step_compiled():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = compiled(x, mask)
            y.backward(dy)

        report("torch BERT-Large layer fwd+bwd B=32 S=128 bf16 (torch.compile)",
               time_cuda(step_compiled, inner=3, warmup=5), flops=flops)
    except Exception as error:  # a missing compiler toolchain on the machine, for example
        print(f"torch BERT-Large layer bf16 (torch.compile): failed: {error}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="gemm,attention,layernorm,kfac,layer,optim")
    args = parser.parse_args()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for part in args.only.split(","):
        {"gemm": bench_gemm, "attention": bench_attention, "layernorm": bench_layernorm,
         "kfac": bench_kfac, "layer": bench_layer, "optim": bench_optim}[part]()


if __name__ == "__main__":
    main()
