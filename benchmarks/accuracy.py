"""Accuracy of DMA configurations against exact attention on LLM-like inputs.

Runs ``dma_jax.attention`` under ``jax.jit`` (on CPU: the jnp reference, DESIGN's
exact numerics) for a few configurations and compares each with float32 exact
attention. The last columns are the rel_l1 of what the sm_90 kernels compute
(``reference_attention(..., operands="fp8")``): by default the same numbers (E4M3
copies, exact for MX formats; NVFP4 tiles from exact bf16 copies), and with the
``nvfp4_copy="e4m3"`` opt-in, NVFP4 re-rounded to E4M3 (within 2^-4 per element).
Prints a table and writes JSON
(``accuracy_<platform>.json`` for the default shape, else with the shape in the name).
Usage:

    python benchmarks/accuracy.py [--seq 1024] [--heads 8] [--kv-heads 2] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time

import jax

import dma_jax
from dma_jax import DMAConfig, reference_attention
from dma_jax.metrics import METRICS, error_metrics
from dma_jax.reference import high_pair_fraction
from dma_jax.synthetic import llm_like_qkv

CONFIGS = {
    "DMA default (diag 1, sink 1, MXFP8 + NVFP4)": DMAConfig(),
    "DMA diag 2, sink 1, MXFP8 + NVFP4": DMAConfig(diag_tiles=2),
    "DMA default with MXFP4 low": DMAConfig(low="mxfp4"),
    "all MXFP8 (e4m3)": DMAConfig.all_high(),
    "all NVFP4": DMAConfig.all_low(),
    "all MXFP4": DMAConfig.all_low(low="mxfp4"),
    "all NVFP4, no smooth-K": DMAConfig.all_low(smooth_k=False),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    causal = not args.non_causal

    q, k, v = llm_like_qkv(
        jax.random.PRNGKey(args.seed), q_len=args.seq, q_heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim,
    )
    exact = dma_jax.exact_attention(q, k, v, causal=causal)
    device = jax.devices()[0]
    print(f"LLM-like bf16 inputs: batch 1, seq {args.seq}, heads {args.heads}:{args.kv_heads}, "
          f"head_dim {args.head_dim}, {'causal' if causal else 'non-causal'}; "
          f"dma_jax.attention under jax.jit on {device.platform} vs float32 exact attention\n")
    header = (f"| {'configuration':45s} | high pairs | " + " | ".join(f"{m:>8s}" for m in METRICS)
              + " | sm_90 rel_l1 | sm_90 E4M3 NVFP4 rel_l1 |")
    print(header)
    print("|" + "-" * 47 + "|-----------:|" + "|".join("-" * 9 + ":" for _ in METRICS)
          + "|-------------:|------------------------:|")
    rows = []
    for name, config in CONFIGS.items():
        f = jax.jit(lambda q, k, v, c=config: dma_jax.attention(q, k, v, causal=causal, config=c))
        start = time.perf_counter()
        out = f(q, k, v).block_until_ready()
        seconds = time.perf_counter() - start
        m = error_metrics(out, exact)
        hopper = error_metrics(reference_attention(q, k, v, causal=causal, config=config, operands="fp8"), exact)
        e4m3 = dataclasses.replace(config, nvfp4_copy="e4m3")
        rounded = error_metrics(reference_attention(q, k, v, causal=causal, config=e4m3, operands="fp8"), exact)
        frac = high_pair_fraction(config, args.seq, causal=causal)
        print(f"| {name:45s} | {frac:10.3f} | " + " | ".join(f"{m[x]:8.5f}" for x in METRICS)
              + f" | {hopper['rel_l1']:12.5f} | {rounded['rel_l1']:23.5f} |", flush=True)
        rows.append({"config": name, "settings": config.__dict__, "high_fraction": frac,
                     "seconds_incl_compile": seconds, **m, "sm90": hopper, "sm90_nvfp4_e4m3": rounded})

    os.makedirs(args.out, exist_ok=True)
    default_shape = (args.seq, args.heads, args.kv_heads, args.head_dim) == (1024, 8, 2, 128)
    shape = "" if default_shape else f"_s{args.seq}_h{args.heads}x{args.kv_heads}_d{args.head_dim}"
    path = os.path.join(args.out, f"accuracy_{device.platform}{shape}.json")
    with open(path, "w") as fh:
        json.dump({
            "date": datetime.date.today().isoformat(),
            "device": str(device), "host": platform.node(),
            "jax": jax.__version__, "args": vars(args), "rows": rows,
        }, fh, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
