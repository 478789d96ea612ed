"""Bandwidth of the fused dual-quantize kernel against a device-to-device copy.

GPU only (torch + triton). For Q/K of shape [B, S, H, D] in bf16 it times, with
``triton.testing.do_bench`` in one run: a plain copy of the tensor (torch), the
smooth-K mean reduction, and the dual quantization (MXFP8 + NVFP4). Bandwidth
counts the bytes each kernel reads and writes. Prints a table, writes JSON.

    python benchmarks/quantize.py [--shapes 1x8192x32x128,1x16384x8x128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import triton

from triton_kernels.quantize import channel_mean, dual_quantize


def quantize_bytes(shape, low: str) -> int:
    b, s, h, d = shape
    n = b * s * h
    written = n * (d + d // 32 + d // 2 + d // (16 if low == "nvfp4" else 32))
    written += n * 4 if low == "nvfp4" else 0
    return n * d * 2 + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x8192x32x128,1x16384x32x128,4x4096x8x128,1x8192x32x64")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quantize.py needs a CUDA GPU")
    rows = []
    print("| shape [B,S,H,D] | copy GB/s | mean GB/s | quantize nvfp4 GB/s | vs copy | quantize mxfp4 GB/s | vs copy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.split("x"))
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3 + 1
        y = torch.empty_like(x)
        mean = channel_mean(x)
        t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300)
        t_mean = triton.testing.do_bench(lambda: channel_mean(x), warmup=50, rep=300)
        row = {"shape": shape, "copy_ms": t_copy, "mean_ms": t_mean}
        row["copy_GBps"] = 2 * x.numel() * 2 / t_copy / 1e6
        row["mean_GBps"] = x.numel() * 2 / t_mean / 1e6
        for low in ("nvfp4", "mxfp4"):
            t = triton.testing.do_bench(lambda: dual_quantize(x, low=low, fold=0.127, mean=mean),
                                        warmup=50, rep=300)
            row[f"{low}_ms"] = t
            row[f"{low}_GBps"] = quantize_bytes(shape, low) / t / 1e6
        rows.append(row)
        print(f"| {text} | {row['copy_GBps']:.0f} | {row['mean_GBps']:.0f} | {row['nvfp4_GBps']:.0f} | "
              f"{row['nvfp4_GBps'] / row['copy_GBps']:.2f} | {row['mxfp4_GBps']:.0f} | "
              f"{row['mxfp4_GBps'] / row['copy_GBps']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "quantize_h200.json" if "H200" in torch.cuda.get_device_name() else "quantize_gpu.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(),
                   "device": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "torch": torch.__version__, "rows": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
