"""Sweep the attention kernels' launch settings; the winners go into
``triton_kernels.tuning`` (``LAUNCH_SM90``, ``LAUNCH_SM90_UNQUANTIZED``, ``SM90_GLUON``).

GPU only. For each (head_dim, causal, P·V mode) it times the attention launch
alone (the plan's quantize launches run once beforehand) with ``triton.testing.do_bench`` at
B=1, S=8192, 32 query and 8 kv heads, DMA default tiles, bf16, for every
candidate (BLOCK_M, BLOCK_N, num_warps, num_stages). Prints a table per key,
the best setting, and writes JSON. ``--unquantized`` sweeps the same kernel
with Q·Kᵀ on the bf16 inputs (``plan.input_attention_plan``, the benchmark's own bf16 path).
``--gluon`` sweeps the Gluon sm_90 kernel's key block and K/V slots instead
(head_dim 128, bf16 P·V).

    python benchmarks/tune_attention.py [--seq 8192] [--head-dims 128] [--pv input] [--unquantized] [--gluon]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os

import torch
import triton

from device_name import gpu_tag
from triton_kernels import plan as plans
from triton_kernels import torch_executor
from triton_kernels.torch_executor import buffer
from triton_kernels.tuning import SM90_GLUON, LaunchConfig

CANDIDATES = [
    LaunchConfig(64, 128, 4, 2), LaunchConfig(64, 128, 4, 3), LaunchConfig(64, 64, 4, 2),
    LaunchConfig(64, 64, 4, 3), LaunchConfig(64, 64, 4, 4), LaunchConfig(128, 128, 8, 2),
    LaunchConfig(128, 128, 8, 3), LaunchConfig(128, 64, 8, 3),
]
# The Gluon kernel: (BLOCK_N, K/V slots); 128 keys and 3 slots do not fit beside bf16 copies.
GLUON_CANDIDATES = [(128, 2), (128, 3), (64, 2), (64, 3), (64, 4)]


def _gluon(block_n: int, stages: int):
    return dataclasses.replace(SM90_GLUON, block_n=block_n, stages_causal=stages, stages_full=stages,
                               stages_bf16_low=stages)


def _label(setting) -> str:
    if isinstance(setting, LaunchConfig):
        return f"{setting.block_m}/{setting.block_n}/{setting.num_warps}/{setting.num_stages}"
    return f"{setting[0]}/{setting[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--pv", choices=("input", "fp8", "both"), default="both", help="which P·V paths")
    parser.add_argument("--unquantized", action="store_true", help="Q·Kᵀ on the bf16 inputs (bf16 P·V only)")
    parser.add_argument("--nvfp4-copy", choices=("bf16", "e4m3"), default="bf16",
                        help="the copies NVFP4 tiles multiply (DMAConfig.nvfp4_copy)")
    parser.add_argument("--gluon", action="store_true",
                        help="sweep the Gluon sm_90 kernel (BLOCK_N / K-V slots) instead")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tune_attention.py needs a CUDA GPU")
    s, hq, hkv = args.seq, 32, 8
    results = []
    pv_modes = {"input": (False,), "fp8": (True,), "both": (False, True)}[args.pv]
    if args.unquantized or args.gluon:
        pv_modes = (False,)
    candidates = GLUON_CANDIDATES if args.gluon else CANDIDATES
    for d, causal, pv_fp8 in itertools.product([int(x) for x in args.head_dims.split(",")], (False, True),
                                               pv_modes):
        g = torch.Generator(device="cuda").manual_seed(d)
        q, k, v = (torch.randn(1, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        inputs = {"q": q, "k": k, "v": v}
        target = torch_executor.target_of(q.device)
        if args.unquantized:
            def plan_for(launch):
                return plans.input_attention_plan(buffer("q", q), buffer("k", k), buffer("v", v), target,
                                                  causal=causal, q_offset=0, sm_scale=d**-0.5, launch=launch)
        else:
            def plan_for(setting):
                kernel = dict(kernel="gluon", gluon=_gluon(*setting)) if args.gluon else dict(kernel="triton",
                                                                                              launch=setting)
                return plans.attention_plan(
                    buffer("q", q), buffer("k", k), buffer("v", v), target, causal=causal, q_offset=0,
                    diag_tiles=1, sink_tiles=1, high="mxfp8_e4m3", low="nvfp4", smooth_k=True, sm_scale=d**-0.5,
                    pv="fp8" if pv_fp8 else "input", nvfp4_copy=args.nvfp4_copy, **kernel)
            prepared = torch_executor.run(plan_for(candidates[0]).launches[:-1], inputs)
            inputs = {**inputs, **prepared}

        def attend(launch):
            return torch_executor.run(plan_for(launch).launches[-1:], inputs)
        flops = 4 * s * s * hq * d / (2 if causal else 1)
        timings = {}
        for setting in candidates:
            try:
                timings[setting] = triton.testing.do_bench(lambda: attend(setting), warmup=10, rep=100)
            except Exception as err:  # e.g. out of shared memory for this shape
                print(f"  {_label(setting)}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
        best = min(timings, key=timings.get)
        key = {"head_dim": d, "causal": causal, "pv_fp8": pv_fp8, "unquantized": args.unquantized,
               "nvfp4_copy": args.nvfp4_copy, "kernel": "gluon" if args.gluon else "triton"}
        print(f"D={d} causal={causal} pv_fp8={pv_fp8} unquantized={args.unquantized} nvfp4_copy={args.nvfp4_copy} "
              f"kernel={key['kernel']}: best {_label(best)} {flops / timings[best] / 1e9:.0f} TFLOP/s; " +
              ", ".join(f"{_label(c)}: {flops / t / 1e9:.0f}" for c, t in timings.items()), flush=True)
        results.append({**key, "best": _label(best),
                        "tflops": [{"setting": _label(c), "tflops": flops / t / 1e9} for c, t in timings.items()]})
    os.makedirs(args.out, exist_ok=True)
    dims = "" if args.head_dims == "128,64" else "_d" + args.head_dims.replace(",", "_")
    dims += "_unquantized" if args.unquantized else "" if args.pv == "both" else f"_pv_{args.pv}"
    dims += "" if args.unquantized or args.nvfp4_copy == "bf16" else "_e4m3"
    dims += "_gluon" if args.gluon else ""
    path = os.path.join(args.out, f"tune_attention{dims}_{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "triton": triton.__version__, "seq": s, "heads": [hq, hkv], "results": results}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
