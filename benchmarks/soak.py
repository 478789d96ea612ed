"""Soak on a GPU: many calls of ``jax.jit(dma_jax.attention)`` and of
``dma_jax.torch_attention`` with varying shapes, interleaved in one process, and the
device memory in use before, during and after. After a warm-up round has compiled every
shape, memory must not grow: a leak shows as a steady climb over the rounds.

    python benchmarks/soak.py [--calls 10000] [--shapes 8] [--out DIR]

Prints a table of memory per round and writes JSON; exits non-zero when memory after the
warm-up grows by more than ``--slack-mb``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax
import jax.numpy as jnp
import numpy as np
import torch

import dma_jax
from device_name import gpu_tag
from dma_jax import DMAConfig, bridge

CONFIGS = (DMAConfig(), DMAConfig.hopper_fast(), DMAConfig(low="mxfp4", diag_tiles=2))


def shapes(n: int, seed: int = 0) -> list[tuple]:
    """``n`` (b, lq, lk, hq, hkv, d, causal, config index) drawn once."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lk = int(rng.integers(1, 4096))
        lq = int(rng.integers(1, lk + 1))
        hkv = int(rng.choice((1, 2, 8)))
        out.append((int(rng.integers(1, 3)), lq, lk, hkv * int(rng.choice((1, 4))), hkv, int(rng.choice((64, 128))),
                    bool(rng.integers(2)), int(rng.integers(len(CONFIGS)))))
    return out


def memory() -> dict[str, int]:
    """Bytes in use on the GPU: JAX's allocator and torch's."""
    stats = jax.devices()[0].memory_stats() or {}
    return {"jax": int(stats.get("bytes_in_use", 0)), "torch": int(torch.cuda.memory_allocated())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10000, help="calls per front end")
    p.add_argument("--shapes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--slack-mb", type=float, default=64.0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        raise SystemExit("benchmarks/soak.py needs an NVIDIA GPU visible to both JAX and torch")
    cases = shapes(args.shapes)
    rng = np.random.default_rng(1)
    inputs = []
    for b, lq, lk, hq, hkv, d, causal, c in cases:
        q = jnp.asarray(rng.standard_normal((b, lq, hq, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((b, lk, hkv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, lk, hkv, d)), jnp.bfloat16)
        inputs.append(((q, k, v), tuple(bridge.to_torch(x) for x in (q, k, v))))
    fns = [jax.jit(lambda q, k, v, causal=causal, c=c: dma_jax.attention(q, k, v, causal=causal, config=CONFIGS[c]))
           for *_, causal, c in cases]

    def one_round(calls: int) -> None:
        out = None
        for i in range(calls):
            j = i % len(cases)
            causal, c = cases[j][6], cases[j][7]
            out = fns[j](*inputs[j][0])
            dma_jax.torch_attention(*inputs[j][1], causal=causal, config=CONFIGS[c])
        if out is not None:
            out.block_until_ready()
        torch.cuda.synchronize()

    one_round(len(cases))  # warm-up: every shape compiled
    rows = [{"round": 0, "calls": 2 * len(cases), **memory()}]
    per_round = max(1, args.calls // args.rounds)
    for r in range(1, args.rounds + 1):
        one_round(per_round)
        rows.append({"round": r, "calls": rows[-1]["calls"] + 2 * per_round, **memory()})
        print(f"round {r}: {rows[-1]['calls']} calls, JAX {rows[-1]['jax'] / 2**20:.1f} MiB, "
              f"torch {rows[-1]['torch'] / 2**20:.1f} MiB", flush=True)
    growth = {k: (rows[-1][k] - rows[1][k]) / 2**20 for k in ("jax", "torch")}
    print(f"growth after the first round: JAX {growth['jax']:+.1f} MiB, torch {growth['torch']:+.1f} MiB")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"soak_{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "shapes": cases, "rows": rows, "growth_mib": growth}, fh, indent=1)
    print(f"wrote {path}")
    sys.exit(1 if max(growth.values()) > args.slack_mb else 0)


if __name__ == "__main__":
    main()
