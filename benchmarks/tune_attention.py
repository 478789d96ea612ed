"""Sweep the attention kernel's launch settings; the winners go into
``triton_kernels.attention.LAUNCH``.

GPU only. For each (head_dim, causal, P·V mode) it times the attention launch
alone (Q and K quantized once beforehand) with ``triton.testing.do_bench`` at
B=1, S=8192, 32 query and 8 kv heads, DMA default tiles, bf16, for every
candidate (BLOCK_M, BLOCK_N, num_warps, num_stages). Prints a table per key,
the best setting, and writes JSON. ``--unquantized`` sweeps the same kernel
with Q·Kᵀ on the bf16 inputs (``input_attention``, the benchmark's own bf16 path).

    python benchmarks/tune_attention.py [--seq 8192] [--head-dims 128] [--pv input] [--unquantized]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch
import triton

from device_name import gpu_tag
from triton_kernels.attention import LaunchConfig, input_attention, mx_attention
from triton_kernels.dma import softmax_fold
from triton_kernels.quantize import channel_mean, dual_quantize, fp8_transpose

CANDIDATES = [
    LaunchConfig(64, 128, 4, 2), LaunchConfig(64, 128, 4, 3), LaunchConfig(64, 64, 4, 2),
    LaunchConfig(64, 64, 4, 3), LaunchConfig(64, 64, 4, 4), LaunchConfig(128, 128, 8, 2),
    LaunchConfig(128, 128, 8, 3), LaunchConfig(128, 64, 8, 3),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--pv", choices=("input", "fp8", "both"), default="both", help="which P·V paths")
    parser.add_argument("--unquantized", action="store_true", help="Q·Kᵀ on the bf16 inputs (bf16 P·V only)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tune_attention.py needs a CUDA GPU")
    s, hq, hkv = args.seq, 32, 8
    results = []
    pv_modes = {"input": (False,), "fp8": (True,), "both": (False, True)}[args.pv]
    if args.unquantized:
        pv_modes = (False,)
    for d, causal, pv_fp8 in itertools.product([int(x) for x in args.head_dims.split(",")], (False, True),
                                               pv_modes):
        g = torch.Generator(device="cuda").manual_seed(d)
        q, k, v = (torch.randn(1, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        if args.unquantized:
            fold = softmax_fold(d**-0.5)

            def attend(launch):
                return input_attention(q, k, v, causal=causal, q_offset=0, qk_scale=fold, launch=launch)
        else:
            q8 = dual_quantize(q, fold=softmax_fold(d**-0.5), codes=False, fp8=True)
            k8 = dual_quantize(k, mean=channel_mean(k), codes=False, fp8=True, per_tile=True)
            vt, v_scale = fp8_transpose(v) if pv_fp8 else (None, None)

            def attend(launch):
                return mx_attention(q8, k8, v, q_len=s, causal=causal, q_offset=0, diag=1, sink=1,
                                    high="mxfp8_e4m3", low="nvfp4", native=(False, False), vt=vt,
                                    v_scale=v_scale, launch=launch)
        flops = 4 * s * s * hq * d / (2 if causal else 1)
        timings = {}
        for launch in CANDIDATES:
            try:
                timings[launch] = triton.testing.do_bench(lambda: attend(launch), warmup=10, rep=100)
            except Exception as err:  # e.g. out of shared memory for this shape
                print(f"  {launch}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
        best = min(timings, key=timings.get)
        key = {"head_dim": d, "causal": causal, "pv_fp8": pv_fp8, "unquantized": args.unquantized}
        print(f"D={d} causal={causal} pv_fp8={pv_fp8} unquantized={args.unquantized}: best {best} "
              f"{flops / timings[best] / 1e9:.0f} TFLOP/s; " +
              ", ".join(f"{c.block_m}/{c.block_n}/{c.num_warps}/{c.num_stages}: {flops / t / 1e9:.0f}"
                        for c, t in timings.items()), flush=True)
        results.append({**key, "best": best.__dict__,
                        "tflops": [{**c.__dict__, "tflops": flops / t / 1e9} for c, t in timings.items()]})
    os.makedirs(args.out, exist_ok=True)
    dims = "" if args.head_dims == "128,64" else "_d" + args.head_dims.replace(",", "_")
    dims += "_unquantized" if args.unquantized else "" if args.pv == "both" else f"_pv_{args.pv}"
    path = os.path.join(args.out, f"tune_attention{dims}_{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "triton": triton.__version__, "seq": s, "heads": [hq, hkv], "results": results}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
