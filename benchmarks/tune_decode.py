"""Sweep the decode kernel's settings (``triton_kernels.tuning.DecodeConfig``: keys per
step, warps, stages, programs aimed for, FP8 values lifted or converted) on Llama-3-8B's
attention shape, with the values in bf16 and in FP8, against cuDNN's bf16 decode in the
same run.

    python benchmarks/tune_decode.py [--shapes 32768x8,32768x64,131072x8] [--calls 30]
        [--lift-values 0,1]

Prints, per shape and value format, the settings by time (ms and speed-up over cuDNN)
and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from decode import D, HQ, HKV, bf16_decode, random_cache, timed
from dma_jax import executor
from triton_kernels.geometry import CACHE_FIELDS
from triton_kernels.tuning import DecodeConfig


def dma_fn(cache, launch: DecodeConfig):
    """decode_attention's launches with the settings ``launch``."""
    sink_len, ring_len = cache.slots

    def fn(q, *arrays):
        plan = executor.decode_plan(q, *arrays, config=cache.config, v_fp8=cache.v_format == "fp8",
                                    sink_len=sink_len, ring_len=ring_len, launch=launch)
        return executor.run(plan.launches, {"q": q, **dict(zip(CACHE_FIELDS, arrays))})[plan.result]
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="32768x8,32768x64,131072x8", help="context x batch, comma separated")
    p.add_argument("--block-n", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--programs", default="264,1056")
    p.add_argument("--lift-values", default="0", help="comma separated: 0 converts FP8 values, 1 lifts them")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    settings = [DecodeConfig(n, w, st, pr, lift_values=bool(lift)) for n, w, st, pr, lift in
                itertools.product(ints(args.block_n), ints(args.warps), ints(args.stages), ints(args.programs),
                                  ints(args.lift_values))]
    key = jax.random.PRNGKey(0)
    results = []
    for shape in args.shapes.split(","):
        context, batch = (int(x) for x in shape.split("x"))
        q = jax.random.normal(key, (batch, 1, HQ, D), jnp.bfloat16)
        kv = jax.random.normal(key, (2, batch, context, HKV, D), jnp.bfloat16)
        cudnn = timed(bf16_decode("cudnn"), (q, kv[0], kv[1], jnp.full((batch,), context, jnp.int32)), args.calls)
        del kv
        for v_format in ("input", "fp8"):
            cache = random_cache(batch, context, v_format, key)
            arrays = [getattr(cache, f) for f in CACHE_FIELDS]
            rows = []
            for s in settings:
                if s.lift_values and v_format != "fp8":
                    continue  # only FP8 values are lifted
                try:
                    ms = timed(dma_fn(cache, s), (q, *arrays), args.calls)
                except Exception as e:  # a setting that does not compile (shared memory, registers)
                    print(f"{shape} {v_format} {s}: {type(e).__name__}", flush=True)
                    continue
                rows.append({"setting": s.__dict__, "ms": ms, "speedup": cudnn / ms})
            rows.sort(key=lambda r: r["ms"])
            results.append({"context": context, "batch": batch, "v_format": v_format, "cudnn_ms": cudnn,
                            "rows": rows})
            print(f"\n{shape}, V {v_format}: cuDNN bf16 {cudnn:.3f} ms")
            for r in rows[:6]:
                print(f"  {r['setting']}  {r['ms']:.3f} ms  {r['speedup']:.2f}x", flush=True)
            del cache
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tune_decode.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                   "results": results}, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
