"""What the compiler emits for Blackwell, without a GPU: every launch of a DMA call
compiled for sm_100a (B200) on the CPU, per configuration and head_dim: the MMA kinds
with their scale blocks and scale types found in the PTX, registers per thread, spills
and shared memory (ptxas -v, the compiled metadata), and the launch settings. Also
tries sm_120 (consumer Blackwell) and reports what compiles there. Needs Triton >= 3.9
(its offline compiler and the ptxas it ships). Prints a table and writes JSON.

    python benchmarks/sm100_static.py [--configs default,mxfp4,...] [--head-dims 64,128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton

from dma_jax import DMAConfig
from triton_kernels.aot import block_scaled_mmas, compile_kernel, ptxas_usage, wgmma_kinds
from triton_kernels.plan import Buffer, attention_plan
from triton_kernels.target import Target

CONFIGS = {
    "default": DMAConfig(),
    "mxfp4": DMAConfig(low="mxfp4"),
    "all_mxfp8": DMAConfig.all_high(),
    "all_nvfp4": DMAConfig.all_low(),
    "all_mxfp4": DMAConfig.all_low(low="mxfp4"),
    "hopper_fast": DMAConfig.hopper_fast(),
}
SEQ, Q_HEADS, KV_HEADS = 4096, 32, 8


def mma_kinds(ptx: str) -> list[str]:
    """The MMAs in ``ptx``: block-scaled tcgen05 as kind/block/scale type
    (``aot.block_scaled_mmas``), other tcgen05 kinds, wgmma and mma.sync kinds."""
    found = {f"tcgen05 {kind} {block} {scale}" for kind, block, scale in block_scaled_mmas(ptx)}
    found.update(f"tcgen05 {k}" for k in re.findall(r"tcgen05[.]mma[.]cta_group::1[.]kind::(f16|tf32|f8f6f4) ", ptx))
    found.update(f"wgmma {k}" for k in wgmma_kinds(ptx))
    found.update(f"mma.sync {k}" for k in re.findall(r"mma[.]sync[.]aligned[.]m16n8k\d+[.]\S*?(block_scale\S*|row[.]col\S*)",
                                                     ptx))
    return sorted(found)


def report(config: str, dim: int, causal: bool, arch: int) -> list[dict]:
    cfg = CONFIGS[config]
    q = Buffer("q", (1, SEQ, Q_HEADS, dim), "bfloat16")
    k = Buffer("k", (1, SEQ, KV_HEADS, dim), "bfloat16")
    plan = attention_plan(q, k, Buffer("v", k.shape, "bfloat16"), Target((arch // 10, arch % 10)), causal=causal,
                          q_offset=0, **cfg.kernel_options(dim))
    rows = []
    for i, launch in enumerate(plan.launches):
        row = {"config": config, "head_dim": dim, "causal": causal, "arch": f"sm_{arch}",
               "launch": f"{i}:{launch.kernel.fn.__name__}", "warps": launch.num_warps, "stages": launch.num_stages,
               "blocks": {k: v for k, v in launch.meta.items() if k.startswith("BLOCK")}}
        try:
            compiled = compile_kernel(plan, launch, {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16"}, arch)
        except Exception as e:  # report what does not compile (sm_120) instead of stopping
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"
            rows.append(row)
            continue
        ptx = compiled.asm["ptx"]
        row.update(ptxas_usage(ptx), shared=compiled.metadata.shared, mma=mma_kinds(ptx))
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--no-sm120", action="store_true", help="skip the sm_120 compile")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        raise SystemExit(f"compiling for sm_100 without a GPU needs triton >= 3.9; this is {triton.__version__}")
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; expected some of {list(CONFIGS)}")
    rows = []
    for config in configs:
        for dim in (int(d) for d in args.head_dims.split(",")):
            for causal in (True, False):
                rows += report(config, dim, causal, 100)
    if not args.no_sm120:
        rows += report("default", 128, True, 120)
    print(f"{'arch':7} {'config':12} {'D':>3} {'causal':6} {'launch':28} {'regs':>4} {'spill':>5} {'smem':>6} "
          f"{'warps':>5}  mma")
    for r in rows:
        if "error" in r:
            print(f"{r['arch']:7} {r['config']:12} {r['head_dim']:>3} {r['causal']!s:6} {r['launch']:28} {r['error']}")
            continue
        print(f"{r['arch']:7} {r['config']:12} {r['head_dim']:>3} {r['causal']!s:6} {r['launch']:28} "
              f"{r['registers']:>4} {r['spill_stores'] + r['spill_loads']:>5} {r['shared']:>6} {r['warps']:>5}  "
              f"{', '.join(r['mma']) or '-'}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sm100_static.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "triton": triton.__version__,
                   "shape": {"seq": SEQ, "heads": [Q_HEADS, KV_HEADS]}, "rows": rows}, fh, indent=1)
    print(f"wrote {path}")
    spilled = [r for r in rows if r["arch"] == "sm_100" and r["config"] == "default" and r.get("spill_stores", 0)]
    sys.exit(1 if spilled else 0)


if __name__ == "__main__":
    main()
