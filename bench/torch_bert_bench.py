#!/usr/bin/env python3
"""PyTorch side of the BERT training-step benchmark, and the side-by-side comparison.

Forward + backward of BertForPreTraining (written like Hugging Face's, with torch.nn modules:
dropout on, MLM head on the masked positions only, NSP), fp32, on N CPU threads, in sequences
per second. With --cpp PATH it alternates runs of our bench_model and of PyTorch, --repeats
times, and prints both medians and the ratio: the machine is shared and noisy, so only a ratio
measured side by side means something.

  scripts/setup.sh --with-torch     # PyTorch from PyPI (MKL, oneDNN) in .venv-torch/
  .venv-torch/bin/python bench/torch_bert_bench.py --preset mini --threads 2 \
      --cpp build/release/bench/bench_model --repeats 5

The first line printed names the torch version and whether MKL and oneDNN serve it: compare
against PyPI's build (the baseline a user would pick), not a distribution's OpenBLAS build.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

PRESETS = {"tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8),
           "medium": (8, 512, 8), "base": (12, 768, 12)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mini", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per PyTorch measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpp", help="path to bench_model: alternate with it and print the ratio")
    parser.add_argument("--cpp-min-time", type=float, default=4.0,
                        help="--benchmark_min_time (seconds) of each bench_model run")
    return parser.parse_args()


ARGS = parse_args()
# The BLAS libraries read their thread counts when they load: set them before importing torch.
for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[variable] = str(ARGS.threads)
import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Layer(nn.Module):
    def __init__(self, h, heads, inter, p):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out, self.attn_norm = nn.Linear(h, h), nn.LayerNorm(h, eps=1e-12)
        self.inter, self.out, self.out_norm = nn.Linear(h, inter), nn.Linear(inter, h), nn.LayerNorm(h, eps=1e-12)
        self.dropout = nn.Dropout(p)

    def forward(self, x, extended_mask):
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, self.d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d) + extended_mask
        probs = self.dropout(torch.softmax(scores, dim=-1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, h)
        x = self.attn_norm(self.dropout(self.attn_out(ctx)) + x)
        return self.out_norm(self.dropout(self.out(F.gelu(self.inter(x)))) + x)


class BertForPreTraining(nn.Module):
    def __init__(self, layers, h, heads, vocab=30522, positions=512, types=2, p=0.1):
        super().__init__()
        self.word = nn.Embedding(vocab, h, padding_idx=0)
        self.position, self.token_type = nn.Embedding(positions, h), nn.Embedding(types, h)
        self.norm, self.dropout = nn.LayerNorm(h, eps=1e-12), nn.Dropout(p)
        self.layers = nn.ModuleList(Layer(h, heads, 4 * h, p) for _ in range(layers))
        self.pooler, self.nsp = nn.Linear(h, h), nn.Linear(h, 2)
        self.transform, self.transform_norm = nn.Linear(h, h), nn.LayerNorm(h, eps=1e-12)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids, types, mask, positions, labels, weights, nsp_labels):
        b, s = ids.shape
        x = self.word(ids) + self.position.weight[:s].unsqueeze(0) + self.token_type(types)
        x = self.dropout(self.norm(x))
        extended = (1.0 - mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            x = layer(x, extended)
        nsp_logits = self.nsp(torch.tanh(self.pooler(x[:, 0])))
        gathered = x[torch.arange(b)[:, None], positions].reshape(-1, x.shape[-1])
        t = self.transform_norm(F.gelu(self.transform(gathered)))
        logits = F.linear(t, self.word.weight, self.decoder_bias)  # tied decoder
        per_position = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
        w = weights.reshape(-1)
        return (per_position * w).sum() / w.sum() + F.cross_entropy(nsp_logits, nsp_labels)


def make_batch(b, s, p, vocab, generator):
    ids = torch.randint(1, vocab, (b, s), generator=generator)
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[1::2, s * 3 // 4:] = 0  # every other sequence padded over its last quarter
    ids = ids * mask
    types = torch.zeros(b, s, dtype=torch.int64)
    types[:, s // 2:] = 1
    positions = torch.stack([torch.randperm(s * 3 // 4 - 1, generator=generator)[:p] + 1 for _ in range(b)])
    labels = torch.randint(1, vocab, (b, p), generator=generator)
    weights = torch.ones(b, p)
    nsp = torch.randint(0, 2, (b,), generator=generator)
    return ids, types, mask, positions, labels, weights, nsp


def torch_seqs_per_second(model, batch):
    def step():
        model.zero_grad(set_to_none=False)
        model(*batch).backward()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(ARGS.steps):
        step()
    return ARGS.steps * ARGS.batch / (time.perf_counter() - start)


def cpp_seqs_per_second():
    name = f"train_step/{ARGS.preset}/batch:{ARGS.batch}/real_time"
    command = [ARGS.cpp, f"--benchmark_filter=^train_step/{ARGS.preset}/batch:{ARGS.batch}/",
               f"--threads={ARGS.threads}", f"--benchmark_min_time={ARGS.cpp_min_time}",
               "--benchmark_format=json"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    for entry in json.loads(result.stdout)["benchmarks"]:
        if entry["name"] == name:
            return entry["items_per_second"]
    sys.exit(f"{name} not in the output of {' '.join(command)} (is the batch size registered?)")


def main():
    torch.set_num_threads(ARGS.threads)
    torch.manual_seed(0)
    layers, hidden, heads = PRESETS[ARGS.preset]
    model = BertForPreTraining(layers, hidden, heads)
    model.train()
    batch = make_batch(ARGS.batch, ARGS.seq, ARGS.predictions, 30522, torch.Generator().manual_seed(7))
    print(f"BERT-{ARGS.preset}, batch {ARGS.batch}, sequence {ARGS.seq}, {ARGS.predictions} predictions, "
          f"{ARGS.threads} threads; torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}, "
          f"oneDNN {torch.backends.mkldnn.is_available()})", flush=True)
    ours, theirs = [], []
    for repeat in range(ARGS.repeats):
        if ARGS.cpp:
            ours.append(cpp_seqs_per_second())
        theirs.append(torch_seqs_per_second(model, batch))
        line = f"run {repeat + 1}: PyTorch {theirs[-1]:.2f} seq/s"
        if ARGS.cpp:
            line += f", C++ {ours[-1]:.2f} seq/s, ratio {ours[-1] / theirs[-1]:.2f}"
        print(line, flush=True)
    print(f"median PyTorch {statistics.median(theirs):.2f} seq/s")
    if ARGS.cpp:
        ratios = [a / b for a, b in zip(ours, theirs)]
        print(f"median C++ {statistics.median(ours):.2f} seq/s")
        print(f"median ratio C++ / PyTorch {statistics.median(ratios):.2f} "
              f"(ratio of medians {statistics.median(ours) / statistics.median(theirs):.2f})")


if __name__ == "__main__":
    main()
