"""Decode attention alone: one new query row per sequence against a long KV cache,
Llama-3-8B's attention shape (32 query heads, 8 kv heads, head_dim 128), DMA decode over
a low-bit cache (V in bf16 and in FP8; sink and band keys in MXFP8, and in bf16 with
bf16 V) against JAX's bf16 decode attention (cuDNN with per-row key lengths, and XLA), in
one run, as ratios. Also the KV-cache bytes per token of each.

    python benchmarks/decode.py [--contexts 4096,16384,32768,131072] [--batches 1,8,64]
        [--max-tokens 2097152] [--calls 50] [--out DIR]

A (context, batch) whose batch x context exceeds ``--max-tokens`` is skipped (memory).
Every row's cache is full (length = context). The cache contents are random valid codes:
the kernels' time does not depend on the values. Calls run back to back inside one
``jax.jit`` per configuration (``--calls`` of them), timed after a warm-up. Prints a
table and writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from plotting import pyplot
from dma_jax import DMAConfig, LowBitKVCache, decode_attention

HQ, HKV, D = 32, 8, 128


# Label: (V format, high format of the sink and band keys).
VARIANTS = {"dma, V bf16": ("input", "mxfp8_e4m3"), "dma, V fp8": ("fp8", "mxfp8_e4m3"),
            "dma, bf16 band, V bf16": ("input", "bf16")}


def random_cache(batch: int, context: int, v_format: str, key: jax.Array, high: str = "mxfp8_e4m3") -> LowBitKVCache:
    """A full cache of random valid codes (no NaN scales) in DMA's default formats, with
    ``high`` for the sink and band keys."""
    c = LowBitKVCache.empty(batch, context, HKV, D, config=DMAConfig(high=high), v_format=v_format)
    ks = jax.random.split(key, 7)

    def codes(k, like, lo, hi):
        return jax.random.randint(k, like.shape, lo, hi, jnp.int32).astype(jnp.uint8)

    v = (codes(ks[5], c.v, 0, 0x7F) if v_format == "fp8"
         else jax.random.normal(ks[5], c.v.shape, jnp.bfloat16))
    return LowBitKVCache(
        lo_codes=codes(ks[0], c.lo_codes, 0, 256), lo_scales=codes(ks[1], c.lo_scales, 0x20, 0x40),
        lo_token=jax.random.uniform(ks[2], c.lo_token.shape, jnp.float32, 0.001, 0.01),
        hi_codes=(jax.random.normal(ks[3], c.hi_codes.shape, jnp.bfloat16) if high == "bf16"
                  else codes(ks[3], c.hi_codes, 0, 0x7F)),
        hi_scales=c.hi_scales if high == "bf16" else codes(ks[4], c.hi_scales, 120, 128),
        v=v, v_scale=codes(ks[6], c.v_scale, 120, 128) if v_format == "fp8" else c.v_scale,
        k_mean=c.k_mean, length=jnp.full((batch,), context, jnp.int32),
        config=c.config, v_format=v_format, dtype=c.dtype)


def timed(fn, args, calls: int) -> float:
    """Milliseconds per call of ``fn(*args)``, ``calls`` back to back in one program."""
    def many(q, *rest):
        def body(i, acc):
            # The query depends on the loop carry, so no call is hoisted out of the loop.
            return acc + fn(q + (acc * 0).astype(q.dtype), *rest)[0, 0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, calls, body, jnp.float32(0))

    run = jax.jit(many)
    run(*args).block_until_ready()
    start = time.perf_counter()
    run(*args).block_until_ready()
    return (time.perf_counter() - start) / calls * 1e3


def bf16_decode(implementation: str):
    def fn(q, k, v, lengths):
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation, key_value_seq_lengths=lengths)
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4096,16384,32768,131072")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--max-tokens", type=int, default=2**21)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    gpu = jax.default_backend() == "gpu"
    baselines = ("cudnn", "xla") if gpu else ("xla",)
    device = jax.devices()[0].device_kind
    rows = []
    key = jax.random.PRNGKey(0)
    for context in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            if batch * context > args.max_tokens:
                continue
            row: dict = {"context": context, "batch": batch, "ms": {}}
            q = jax.random.normal(key, (batch, 1, HQ, D), jnp.bfloat16)
            kv = jax.random.normal(key, (2, batch, context, HKV, D), jnp.bfloat16)
            lengths = jnp.full((batch,), context, jnp.int32)
            for name in baselines:
                row["ms"][f"{name} bf16"] = timed(bf16_decode(name), (q, kv[0], kv[1], lengths), args.calls)
            del kv
            for label, (v_format, high) in VARIANTS.items():
                cache = random_cache(batch, context, v_format, key, high)
                row["ms"][label] = timed(decode_attention, (q, cache), args.calls)
                del cache
            best = min(row["ms"][f"{n} bf16"] for n in baselines)
            row["speedup"] = {k: best / v for k, v in row["ms"].items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    per_token = {"bf16": 4 * D, **{label: LowBitKVCache.bytes_per_token(D, v_format=v_format, context=32768,
                                                                         config=DMAConfig(high=high))
                                   for label, (v_format, high) in VARIANTS.items()}}
    names = list(rows[0]["ms"]) if rows else []
    print(f"\n{device}, decode attention, {HQ}:{HKV} heads, D={D}, bf16 queries; ms per call "
          f"(speed-up over the best bf16 baseline)")
    print(f"{'context':>8} {'batch':>5} | " + " | ".join(f"{n:>18}" for n in names))
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>5} | "
              + " | ".join(f"{r['ms'][n]:8.3f} ({r['speedup'][n]:4.2f}x)" for n in names))
    print("KV bytes per token and kv head (32k context): "
          + ", ".join(f"{k} {v:.1f} ({per_token['bf16'] / v:.2f}x smaller)" for k, v in per_token.items()))
    os.makedirs(args.out, exist_ok=True)
    tag = "cpu" if not gpu else device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    path = os.path.join(args.out, f"decode_{tag}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": device, "jax": jax.__version__,
                   "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}, "calls": args.calls,
                   "bytes_per_token": per_token, "rows": rows}, fh, indent=2)
    print(f"wrote {path}")
    _plot(rows, path[:-5] + ".png")


def _plot(rows, path) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    names = [n for n in rows[0]["ms"]]
    labels = [f"{r['context'] // 1024}k x{r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar(np.arange(len(rows)) + i * width, [r["speedup"][n] for r in rows], width, label=n)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels)
    ax.set_ylabel("speed-up over the best bf16 decode")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
