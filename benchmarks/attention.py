"""Attention speed on one GPU: DMA (JAX and torch paths) next to the baselines.

In one run, on the same bf16 inputs (batch 1, 32 heads): DMA through
``jax.jit(dma_jax.attention)`` and through ``dma_jax.torch_attention`` (both
include the smooth-K mean and the quantization of Q and K), cuDNN and XLA
attention through ``jax.nn.dot_product_attention``, and torch SDPA.
JAX functions are timed as back-to-back asynchronous calls (dispatch N, block on
the last); torch with ``triton.testing.do_bench``. Inputs rotate through enough
copies to exceed the 60 MB L2. TFLOP/s = 4·B·H·S²·D / t, halved when causal.

    python benchmarks/attention.py [--seqs 1024,2048,...] [--head-dims 128,64] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import torch
import triton

import dma_jax
from dma_jax import bridge

HEADS = 32
L2_BYTES = 60 * 2**20
XLA_MAX_SEQ = 8192  # XLA materialises the S×S scores: 32 heads at 16k need 34 GB+


def copies_needed(seq: int, dim: int) -> int:
    per_set = 3 * seq * HEADS * dim * 2
    return max(1, min(8, -(-2 * L2_BYTES // per_set)))


def time_jax(fn, sets, min_seconds=0.25) -> float:
    f = jax.jit(fn)
    jax.block_until_ready(f(*sets[0]))  # compile and warm up
    n, elapsed = 4, 0.0
    while elapsed < min_seconds:
        n *= 2
        start = time.perf_counter()
        for i in range(n):
            out = f(*sets[i % len(sets)])
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
    return elapsed / n * 1e3


def time_torch(fn, sets) -> float:
    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--quick", action="store_true", help="seqs 1024,8192, head_dim 128")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    seqs = [1024, 8192] if args.quick else [int(s) for s in args.seqs.split(",")]
    dims = [128] if args.quick else [int(d) for d in args.head_dims.split(",")]

    impls = {
        "dma_jax": ("jax", lambda causal: lambda q, k, v: dma_jax.attention(q, k, v, causal=causal)),
        "dma_torch": ("torch", lambda causal: lambda q, k, v: dma_jax.torch_attention(q, k, v, causal=causal)),
        "cudnn_bf16": ("jax", lambda causal: lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")),
        "xla_bf16": ("jax", lambda causal: lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla")),
        "torch_sdpa_bf16": ("torch", lambda causal: lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)),
    }
    rows = []
    names = list(impls)
    print(f"{torch.cuda.get_device_name()}, batch 1, {HEADS} heads, bf16; TFLOP/s (ratio to cudnn_bf16)")
    print("| D | causal | S | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for dim, causal, seq in itertools.product(dims, (False, True), seqs):
        key = jax.random.PRNGKey(seq + dim)
        sets = []
        for i in range(copies_needed(seq, dim)):
            ks = jax.random.split(jax.random.fold_in(key, i), 3)
            sets.append([jax.random.normal(kk, (1, seq, HEADS, dim), jnp.bfloat16) for kk in ks])
        torch_sets = [[bridge.to_torch(x) for x in s] for s in sets]
        flops = 4 * seq * seq * HEADS * dim / (2 if causal else 1)
        row = {"head_dim": dim, "causal": causal, "seq": seq, "ms": {}, "tflops": {}}
        for name, (kind, make) in impls.items():
            if name == "xla_bf16" and seq > XLA_MAX_SEQ:
                continue
            fn = make(causal)
            ms = time_jax(fn, sets) if kind == "jax" else time_torch(fn, torch_sets)
            row["ms"][name] = ms
            row["tflops"][name] = flops / ms / 1e9
        base = row["tflops"]["cudnn_bf16"]
        cells = [f"{row['tflops'][n]:.0f} ({row['tflops'][n] / base:.2f}×)" if n in row["tflops"] else "n/a"
                 for n in names]
        print(f"| {dim} | {causal} | {seq} | " + " | ".join(cells) + " |", flush=True)
        rows.append(row)
        del sets, torch_sets

    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name().split()[-1].lower()  # "h200"
    path = os.path.join(args.out, f"attention_{gpu}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "jax": jax.__version__, "torch": torch.__version__, "triton": triton.__version__,
                   "heads": HEADS, "dtype": "bfloat16", "rows": rows}, fh, indent=2)
    print(f"wrote {path}")
    _plot(rows, os.path.join(args.out, f"attention_{gpu}.png"))


def _plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (dim, causal) in zip(axes[0], panels):
        sel = [r for r in rows if r["head_dim"] == dim and r["causal"] == causal]
        for name in sel[0]["tflops"]:
            pts = [(r["seq"], r["tflops"][name]) for r in sel if name in r["tflops"]]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={dim}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
