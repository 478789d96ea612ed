"""How exact are the FP8 copies that Hopper's tensor cores read?

For Q and K (after smooth-K and the softmax-scale fold, as the kernel sees them)
of structured LLM-like inputs and of SmolLM2-135M's own activations (every
layer, one 512-token window of the held-out text), it compares the E4M3 copies
(values x scale) with the exact dequantized MX/NVFP4 values: Q's copy with a
scale per token (``dma_jax.formats.fp8_per_token``), K's with a scale per
128-key tile (``fp8_per_tile``, what the kernel reads) and, for comparison, K
per token. It counts the fraction of nonzero elements that differ, and their
mean and maximum relative change. MX formats differ only where a block sits far
below the largest of its token (tile) (E4M3 subnormals); NVFP4 also rounds to 4
significant bits. CPU, jnp. Prints a table and writes JSON.

    python benchmarks/fp8_copies.py [--seq 4096] [--no-model]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # models/, the repository's example

import jax
import jax.numpy as jnp
import numpy as np

from dma_jax import dequantize, quantize
from dma_jax.formats import fp8_per_tile, fp8_per_token
from dma_jax.synthetic import llm_like_qkv

FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4")


def prepared(q, k, head_dim):
    """Q times sm_scale·log2(e) and K minus its mean over tokens, in float32."""
    fold = np.float32(head_dim**-0.5 * math.log2(math.e))
    k32 = k.astype(jnp.float32)
    return q.astype(jnp.float32) * fold, k32 - jnp.mean(k32, axis=1, keepdims=True)


def changes(x, fmt, copy_of: str) -> tuple[int, int, float, float]:
    """(nonzero elements, changed elements, sum of relative changes, max relative change).

    The exact values are float32 (``(e · sb) · s2`` is rounded for NVFP4), so changes
    below 2^-20 are float32 rounding, not the FP8 copy, and do not count as changed."""
    qz = quantize(x, fmt)
    exact = np.asarray(dequantize(qz, fmt), np.float64)
    if copy_of == "tile":
        values, scale = fp8_per_tile(qz, fmt, 128, axis=1)
        scale = np.repeat(np.asarray(scale, np.float64), 128, axis=1)[:, : x.shape[1]]
    else:
        values, scale = fp8_per_token(qz, fmt)
    copy = np.asarray(values, np.float64) * np.asarray(scale, np.float64)[..., None]
    nz = exact != 0
    rel = np.abs(copy[nz] - exact[nz]) / np.abs(exact[nz])
    rel = np.where(rel > 2.0**-20, rel, 0.0)
    return int(nz.sum()), int((rel > 0).sum()), float(rel.sum()), float(rel.max(initial=0.0))


COPIES = (("Q per token", 0, "token"), ("K per tile (kernel)", 1, "tile"), ("K per token", 1, "token"))


def report(name: str, pairs, table: dict) -> None:
    for fmt in FORMATS:
        for label, which, copy_of in COPIES:
            n = changed = 0
            total = worst = 0.0
            for pair in pairs:
                a, b, c, d = changes(pair[which], fmt, copy_of)
                n, changed, total, worst = n + a, changed + b, total + c, max(worst, d)
            row = {"elements": n, "changed_fraction": changed / n, "mean_rel_change": total / n,
                   "max_rel_change": worst}
            table.setdefault(name, {}).setdefault(fmt, {})[label] = row
            print(f"| {name} | {fmt} | {label} | {n} | {row['changed_fraction']:.2e} | "
                  f"{row['mean_rel_change']:.2e} | {worst:.3f} |", flush=True)


def model_pairs():
    from models.llama import AttentionSpec, load_checkpoint
    from quality import windows

    model, make_tokenizer = load_checkpoint(None)
    spec = AttentionSpec.named("exact")
    scale = model.config.head_dim**-0.5
    pairs = []

    def attend(i, q, k, v):
        pairs.append(prepared(q, k, model.config.head_dim))
        return spec.prefill_fn(q, k, v, sm_scale=scale)

    tokens = jnp.asarray(windows(make_tokenizer(), 512, 1))
    model.run_layers(tokens, jnp.arange(tokens.shape[1]), attend)
    return pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--no-model", action="store_true", help="synthetic inputs only")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    print("elements of the FP8 copies that differ from the exact MX/NVFP4 value")
    print("| inputs | format | copy | nonzero elements | changed fraction | mean relative change | "
          "max relative change |")
    print("|---|---|---|---:|---:|---:|---:|")
    table: dict = {}
    q, k, _ = llm_like_qkv(jax.random.PRNGKey(0), q_len=args.seq, q_heads=32, kv_heads=8, head_dim=128)
    report(f"llm_like_qkv S={args.seq} 32:8 D=128", [prepared(q, k, 128)], table)
    if not args.no_model:
        report("SmolLM2-135M, 30 layers, 512 tokens", model_pairs(), table)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8_copies_cpu.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "results": table}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
