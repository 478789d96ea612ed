"""Bandwidth of the fused dual-quantize kernel against a device-to-device copy.

GPU only (torch + triton). For Q/K of shape [B, S, H, D] in bf16 it times, with
``triton.testing.do_bench`` in one run: a plain copy of the tensor (torch), the
smooth-K mean reduction, the dual quantization (MXFP8 + NVFP4 or MXFP4) in its
three output modes (the FP8 copies sm_90 reads with a scale per token as for Q
or per 128-token tile as for K, the codes sm_100 reads) and V's transposed FP8
copy. Two more tables time, side by side, the smooth-K mean at each of ``MEAN_CHUNKS``
tokens per program next to the chunk ``mean_chunk`` picks for the shape, and K's
per-tile NVFP4 copies at each of ``K_TILE_TOKENS`` tokens per program next to
``k_tile_tokens``' pick. Bandwidth counts the
bytes each kernel reads and writes. Times are medians of CUDA-graph replays
(``do_bench_cudagraph``): these launches take tens of µs, less than the host time of a
torch executor call (output allocation and Triton's argument binding), which would dominate
a call-by-call timing. The replays do not flush L2
between calls; the default shapes' inputs (64-128 MiB) are larger than the H200's 50 MiB L2.
Prints a table, writes JSON.

    python benchmarks/quantize.py [--shapes 1x8192x32x128,1x16384x8x128]

``--once`` launches the sm_90 modes once each at 8k tokens (Q with 32 heads: NVFP4 and MXFP4
low copies, a scale per token; K with 8 heads: NVFP4, a scale per 128-token tile) and exits,
for a hardware profile (``results/ncu_quantize_h200.txt``, metrics as for
``profile_attention.py``)::

    ncu --clock-control none -k regex:_dual_quantize -c 3 --metrics "$METRICS" \\
        python benchmarks/quantize.py --once
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import triton

from device_name import gpu_tag
from triton_kernels.torch_executor import channel_mean, dual_quantize, fp8_transpose
from triton_kernels.tuning import K_TILE_TOKENS, MEAN_CHUNKS, k_tile_tokens, mean_chunk


def quantize_bytes(shape, low: str, mode: str) -> int:
    """Bytes read and written by one dual-quantize launch of a bf16 [B, S, H, D]."""
    b, s, h, d = shape
    n = b * s * h
    if mode.startswith("bf16lo"):  # an E4M3 copy, NVFP4's bf16 copy, two float32 token scales
        written = n * (3 * d + 8)
    elif mode.startswith("fp8_tile"):  # two E4M3 copies, two float32 scales per 128 tokens (input read once counted)
        written = n * 2 * d + 8 * b * h * -(-s // 128)
    elif mode.startswith("fp8"):  # two E4M3 copies and two float32 token scales
        written = n * (2 * d + 8)
    else:  # codes and scales of both formats (+ NVFP4's token scale)
        written = n * (d + d // 32 + d // 2 + d // (16 if low == "nvfp4" else 32))
        written += n * 4 if low == "nvfp4" else 0
    return n * d * 2 + written


def bench(fn) -> float:
    """Median milliseconds of ``fn``'s GPU work, replayed as a CUDA graph (no host time)."""
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


# The sm_90 copies of Q (fp8) and K (fp8_tile), with NVFP4's exact bf16 copies (bf16lo, what
# DMA's default writes on sm_90), with the Hadamard rotation (_rot), and the sm_100 codes.
MODES = {"fp8": dict(codes=False, fp8=True), "fp8_tile": dict(codes=False, fp8=True, per_tile=True),
         "bf16lo": dict(codes=False, fp8=True, lo_bf16=True),
         "bf16lo_rot": dict(codes=False, fp8=True, lo_bf16=True, rotate=True),
         "fp8_rot": dict(codes=False, fp8=True, rotate=True),
         "fp8_tile_rot": dict(codes=False, fp8=True, per_tile=True, rotate=True),
         "codes": dict(codes=True, fp8=False)}
# The low formats each mode is measured with (NVFP4's bf16 copy has no MXFP4 counterpart).
MODE_LOWS = {mode: ("nvfp4",) if mode.startswith("bf16lo") else ("nvfp4", "mxfp4") for mode in MODES}


def print_by_setting(title: str, shapes: list[str], rows: list[dict], key: str, settings: tuple[int, ...],
                     picked: str) -> None:
    """A table of ``row[key][setting]`` (ms) in µs per shape, as ratios to the first
    setting, next to the setting the library picks (``row[picked]``)."""
    print(f"\n{title}")
    print("| shape [B,S,H,D] | " + " | ".join(str(v) for v in settings) + " | picked |")
    print("|---|" + "---:|" * (len(settings) + 1))
    for text, row in zip(shapes, rows):
        by = row[key]
        cells = [f"{by[v] * 1e3:.1f} ({by[v] / by[settings[0]]:.2f})" for v in settings]
        print(f"| {text} | " + " | ".join(cells) + f" | {row[picked]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x8192x32x128,1x16384x32x128,4x4096x8x128,1x8192x32x64")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--once", action="store_true", help="launch the sm_90 modes once (for ncu) and exit")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quantize.py needs a CUDA GPU")
    if args.once:
        q = torch.randn((1, 8192, 32, 128), device="cuda", dtype=torch.bfloat16) * 3 + 1
        k = torch.randn((1, 8192, 8, 128), device="cuda", dtype=torch.bfloat16) * 3 + 1
        for low in ("nvfp4", "mxfp4"):
            dual_quantize(q, low=low, fold=0.127, **MODES["fp8"])
        dual_quantize(k, mean=channel_mean(k), **MODES["fp8_tile"])
        torch.cuda.synchronize()
        return
    rows = []
    cols = [f"{mode} {low}" for mode in MODES for low in MODE_LOWS[mode]]
    print("GB/s (fraction of copy bandwidth); fp8 = the sm_90 copies (Q), fp8_tile = with one scale per "
          "128 tokens (K; reads its input twice, counted once), bf16lo = NVFP4's exact bf16 copy (DMA's "
          "default on sm_90), _rot = with the Hadamard rotation, codes = the sm_100 codes")
    print("| shape [B,S,H,D] | copy GB/s | mean | " + " | ".join(cols) + " | V fp8 transpose |")
    print("|---|---:|---:|" + "---:|" * (len(cols) + 1))
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.split("x"))
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3 + 1
        y = torch.empty_like(x)
        mean = channel_mean(x)
        t_copy = bench(lambda: y.copy_(x))
        t_mean = bench(lambda: channel_mean(x))
        copy_bw = 2 * x.numel() * 2 / t_copy / 1e6
        row = {"shape": shape, "copy_ms": t_copy, "mean_ms": t_mean, "copy_GBps": copy_bw,
               "mean_GBps": x.numel() * 2 / t_mean / 1e6}
        cells = [f"{row['mean_GBps']:.0f} ({row['mean_GBps'] / copy_bw:.2f})"]
        for mode, low in ((m, lo) for m in MODES for lo in MODE_LOWS[m]):
            t = bench(lambda: dual_quantize(x, low=low, fold=0.127, mean=mean, **MODES[mode]))
            bw = quantize_bytes(shape, low, mode) / t / 1e6
            row[f"{mode}_{low}_ms"], row[f"{mode}_{low}_GBps"] = t, bw
            cells.append(f"{bw:.0f} ({bw / copy_bw:.2f})")
        t = bench(lambda: fp8_transpose(x))
        bw = x.numel() * (2 + 2 + 1) / t / 1e6  # read twice (amax, values), write one byte
        row["v_transpose_ms"], row["v_transpose_GBps"] = t, bw
        cells.append(f"{bw:.0f} ({bw / copy_bw:.2f})")
        row["mean_chunk"] = mean_chunk(shape)
        row["mean_by_chunk_ms"] = {c: bench(lambda c=c: channel_mean(x, chunk=c)) for c in MEAN_CHUNKS}
        row["k_tile_tokens"] = k_tile_tokens(shape)
        row["k_tile_by_tokens_ms"] = {
            t: bench(lambda t=t: dual_quantize(x, mean=mean, tile_t=t, **MODES["fp8_tile"])) for t in K_TILE_TOKENS}
        rows.append(row)
        print(f"| {text} | {copy_bw:.0f} | " + " | ".join(cells) + " |", flush=True)
    shapes = args.shapes.split(",")
    print_by_setting("smooth-K mean, µs per chunk of tokens per program (ratio to the largest chunk)",
                     shapes, rows, "mean_by_chunk_ms", MEAN_CHUNKS, "mean_chunk")
    print_by_setting("K's per-tile NVFP4 FP8 copies, µs per tokens per program (ratio to whole tiles)",
                     shapes, rows, "k_tile_by_tokens_ms", K_TILE_TOKENS, "k_tile_tokens")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"quantize_{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(),
                   "device": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "torch": torch.__version__, "rows": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
