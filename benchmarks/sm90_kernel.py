"""The Gluon sm_90 attention kernel (``triton_kernels.attention_sm90``) against the
Triton kernel (``triton_kernels.attention``), on the same quantized operands.

GPU only (Hopper). Two parts, one run:

1. Agreement: both kernels on the same Q/K copies and V, small odd shapes (GQA,
   kv_len and q_len not multiples of 128, q_offset, causal or not, low tiles or all
   high, bf16 or FP8 P·V). Prints the relative L2 difference of the outputs and their
   errors against float64 exact attention (``tests/oracle.py``-style, computed here
   in torch float64).
2. Speed: the attention launch alone, B=1, 32:8 heads, for DMA default tiles
   (bf16 P·V) and the Hopper preset (all high, FP8 P·V), timed as back-to-back
   launches between CUDA events (medians of 5 runs of 20 launches), with torch's
   SDPA (bf16, cuDNN/flash) in the same run for scale.

Writes ``results/sm90_kernel_h200.json``.

    python benchmarks/sm90_kernel.py [--seqs 8192,16384] [--head-dims 128,64] [--stages 2]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton

from triton_kernels.attention import band_covering_all, mx_attention
from triton_kernels.attention_sm90 import sm90_attention
from triton_kernels.dma import softmax_fold
from triton_kernels.quantize import channel_mean, dual_quantize, fp8_transpose


def exact(q, k, v, causal, q_offset):
    """float64 softmax(Q·Kᵀ/√d)·V with GQA and a causal offset."""
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    s = qd @ kd.transpose(-1, -2) * d**-0.5
    if causal:
        qi = torch.arange(lq, device=q.device)[:, None] + q_offset
        kj = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


def operands(q, k, v, *, has_lo: bool, pv_fp8: bool):
    d = q.shape[-1]
    copies = dict(codes=False, fp8=True, write_lo=has_lo)
    q8 = dual_quantize(q, fold=softmax_fold(d**-0.5), **copies)
    k8 = dual_quantize(k, mean=channel_mean(k), per_tile=True, **copies)
    vt, v_scale = fp8_transpose(v) if pv_fp8 else (None, None)
    return q8, k8, vt, v_scale


def both(q8, k8, v, vt, v_scale, *, q_len, causal, q_offset, diag, sink, has_lo, stages=2):
    kw = dict(q_len=q_len, causal=causal, q_offset=q_offset, diag=diag, sink=sink, has_lo=has_lo, vt=vt,
              v_scale=v_scale)
    triton_fn = lambda: mx_attention(q8, k8, v, high="mxfp8_e4m3", low="nvfp4", native=(False, False), **kw)  # noqa: E731
    gluon_fn = lambda: sm90_attention(q8, k8, v, stages=stages, **kw)  # noqa: E731
    return triton_fn, gluon_fn


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def agreement() -> list[dict]:
    rows = []
    cases = [
        # (B, Lq, Lk, HQ, HKV, D, q_offset)
        (2, 300, 300, 8, 2, 128, 0),
        (1, 200, 700, 4, 4, 128, 500),
        (1, 1000, 1000, 4, 1, 64, 0),
        (1, 129, 1200, 2, 2, 128, 1071),
    ]
    for (b, lq, lk, hq, hkv, d, off), causal, (diag, sink, pv_fp8) in itertools.product(
            cases, (False, True), ((1, 1, False), (2, 0, True), (None, 0, True), (None, 0, False))):
        g = torch.Generator(device="cuda").manual_seed(lq + lk + d)
        q = torch.randn(b, lq, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(b, lk, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, lk, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        if diag is None:
            diag = band_covering_all(lq, lk, off)
        has_lo = diag < band_covering_all(lq, lk, off)
        q8, k8, vt, v_scale = operands(q, k, v, has_lo=has_lo, pv_fp8=pv_fp8)
        t_fn, g_fn = both(q8, k8, v, vt, v_scale, q_len=lq, causal=causal, q_offset=off, diag=diag, sink=sink,
                          has_lo=has_lo)
        ot, og = t_fn(), g_fn()
        ref = exact(q, k, v, causal, off)
        # Rows with no valid key (causal, q_offset < 0 never here) would be 0 in both.
        row = dict(shape=[b, lq, lk, hq, hkv, d], q_offset=off, causal=causal, diag=diag, sink=sink,
                   has_lo=has_lo, pv_fp8=pv_fp8, gluon_vs_triton=rel_l2(og, ot),
                   triton_err=rel_l2(ot, ref), gluon_err=rel_l2(og, ref),
                   nan=bool(torch.isnan(og).any().item()))
        rows.append(row)
        print(f"{row['shape']} off={off} causal={causal} diag={diag} sink={sink} lo={has_lo} fp8pv={pv_fp8}: "
              f"gluon vs triton {row['gluon_vs_triton']:.2e}, err triton {row['triton_err']:.4f} "
              f"gluon {row['gluon_err']:.4f}{' NaN!' if row['nan'] else ''}", flush=True)
    return rows


def back_to_back(fn, n: int = 20, repeats: int = 5) -> float:
    """Median milliseconds per launch over ``repeats`` runs of ``n`` launches in a row."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / n)
    return sorted(times)[len(times) // 2]


def speed(seqs, head_dims, stages) -> list[dict]:
    rows = []
    hq, hkv = 32, 8
    for s, d, causal, preset in itertools.product(seqs, head_dims, (False, True), (False, True)):
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q = torch.randn(1, s, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        diag, sink, has_lo = (band_covering_all(s, s, 0), 0, False) if preset else (1, 1, True)
        q8, k8, vt, v_scale = operands(q, k, v, has_lo=has_lo, pv_fp8=preset)
        t_fn, g_fn = both(q8, k8, v, vt, v_scale, q_len=s, causal=causal, q_offset=0, diag=diag, sink=sink,
                          has_lo=has_lo, stages=stages)
        qt, kt, vt_ = (x.transpose(1, 2) for x in (q, k, v))
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt_, is_causal=causal, enable_gqa=True)  # noqa: E731
        flops = 4 * s * s * hq * d / (2 if causal else 1)
        ms = {name: back_to_back(fn) for name, fn in (("triton", t_fn), ("gluon", g_fn), ("sdpa_bf16", sdpa))}
        diff = rel_l2(g_fn(), t_fn())
        row = dict(seq=s, head_dim=d, causal=causal, config="hopper_fast" if preset else "default",
                   ms=ms, tflops={k_: flops / t / 1e9 for k_, t in ms.items()}, gluon_vs_triton=diff)
        rows.append(row)
        tf = row["tflops"]
        print(f"| {s} | {d} | {causal} | {row['config']} | {tf['triton']:.0f} | {tf['gluon']:.0f} | "
              f"{tf['sdpa_bf16']:.0f} | {tf['gluon'] / tf['triton']:.2f} | {tf['gluon'] / tf['sdpa_bf16']:.2f} | "
              f"{diff:.1e} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("benchmarks/sm90_kernel.py needs a Hopper GPU")
    agree = [] if args.skip_agreement else agreement()
    print("\n| S | D | causal | config | Triton TFLOP/s | Gluon | SDPA bf16 | Gluon/Triton | Gluon/SDPA | rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = speed([int(x) for x in args.seqs.split(",")], [int(x) for x in args.head_dims.split(",")], args.stages)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sm90_kernel_h200.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "triton": triton.__version__, "torch": torch.__version__, "stages": args.stages,
                   "agreement": agree, "speed": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
