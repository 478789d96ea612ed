"""The Gluon sm_90 attention kernel (``triton_kernels.attention_sm90``) against the
Triton kernel (``triton_kernels.attention``), on the same quantized operands.

GPU only (Hopper). Two parts, one run:

1. Agreement: both kernels on the same Q/K copies and V, small odd shapes (GQA,
   kv_len and q_len not multiples of 128, q_offset, causal or not, low tiles or all
   high). Prints the relative L2 difference of the outputs and their errors against
   float64 exact attention (``tests/oracle.py``-style, computed here in torch float64).
2. Speed: the attention launch alone, B=1, 32:8 heads, for DMA default tiles and
   all tiles high (both with bf16 P·V, the only P·V the Gluon kernel has), timed as
   back-to-back launches between CUDA events (medians of 5 runs of 20 launches):
   the Triton kernel, the Gluon kernel with its default launch settings and with
   the other number of slots in its K/V ring (2 or 3), and torch's SDPA (bf16,
   cuDNN/flash) for scale.

Writes ``results/sm90_kernel_<gpu>.json`` (``device_name.gpu_tag``).

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

from device_name import gpu_tag
from triton_kernels.attention import band_covering_all, mx_attention
from triton_kernels.attention_sm90 import launch_meta, sm90_attention
from triton_kernels.dma import softmax_fold
from triton_kernels.quantize import channel_mean, dual_quantize


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


def operands(q, k, *, has_lo: bool):
    d = q.shape[-1]
    copies = dict(codes=False, fp8=True, write_lo=has_lo)
    q8 = dual_quantize(q, fold=softmax_fold(d**-0.5), **copies)
    k8 = dual_quantize(k, mean=channel_mean(k), per_tile=True, **copies)
    return q8, k8


def kernels(q8, k8, v, *, q_len, causal, q_offset, diag, sink, has_lo):
    """{name: launch} for the Triton kernel, the Gluon kernel and the Gluon kernel
    with the other number of K/V slots, on the same operands."""
    kw = dict(q_len=q_len, causal=causal, q_offset=q_offset, diag=diag, sink=sink, has_lo=has_lo)
    stages = launch_meta(v.shape[-1], causal, has_lo)["STAGES"]
    return {
        "triton": lambda: mx_attention(q8, k8, v, high="mxfp8_e4m3", low="nvfp4", native=(False, False), **kw),
        "gluon": lambda: sm90_attention(q8, k8, v, **kw),
        "gluon_other_stages": lambda: sm90_attention(q8, k8, v, STAGES={2: 3, 3: 2}[stages], **kw),
    }


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
    for (b, lq, lk, hq, hkv, d, off), causal, (diag, sink) in itertools.product(
            cases, (False, True), ((1, 1), (2, 0), (None, 0))):
        g = torch.Generator(device="cuda").manual_seed(lq + lk + d)
        q = torch.randn(b, lq, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(b, lk, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, lk, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        if diag is None:
            diag = band_covering_all(lq, lk, off)
        has_lo = diag < band_covering_all(lq, lk, off)
        q8, k8 = operands(q, k, has_lo=has_lo)
        fns = kernels(q8, k8, v, q_len=lq, causal=causal, q_offset=off, diag=diag, sink=sink, has_lo=has_lo)
        ot, og = fns["triton"](), fns["gluon"]()
        ref = exact(q, k, v, causal, off)
        # Rows with no valid key (causal, q_offset < 0 never here) would be 0 in both.
        row = dict(shape=[b, lq, lk, hq, hkv, d], q_offset=off, causal=causal, diag=diag, sink=sink,
                   has_lo=has_lo, gluon_vs_triton=rel_l2(og, ot),
                   triton_err=rel_l2(ot, ref), gluon_err=rel_l2(og, ref),
                   nan=bool(torch.isnan(og).any().item()))
        rows.append(row)
        print(f"{row['shape']} off={off} causal={causal} diag={diag} sink={sink} lo={has_lo}: "
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


def speed(seqs, head_dims) -> list[dict]:
    rows = []
    hq, hkv = 32, 8
    for s, d, causal, all_high in itertools.product(seqs, head_dims, (False, True), (False, True)):
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q = torch.randn(1, s, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        diag, sink, has_lo = (band_covering_all(s, s, 0), 0, False) if all_high else (1, 1, True)
        q8, k8 = operands(q, k, has_lo=has_lo)
        fns = kernels(q8, k8, v, q_len=s, causal=causal, q_offset=0, diag=diag, sink=sink, has_lo=has_lo)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        fns["sdpa_bf16"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        flops = 4 * s * s * hq * d / (2 if causal else 1)
        ms = {name: back_to_back(fn) for name, fn in fns.items()}
        diff = rel_l2(fns["gluon"](), fns["triton"]())
        row = dict(seq=s, head_dim=d, causal=causal, tiles="all high" if all_high else "default",
                   ms=ms, tflops={k_: flops / t / 1e9 for k_, t in ms.items()}, gluon_vs_triton=diff)
        rows.append(row)
        tf = row["tflops"]
        print(f"| {s} | {d} | {causal} | {row['tiles']} | {tf['triton']:.0f} | {tf['gluon']:.0f} | "
              f"{tf['gluon_other_stages']:.0f} | {tf['sdpa_bf16']:.0f} | "
              f"{tf['gluon'] / tf['triton']:.2f} | {tf['gluon'] / tf['sdpa_bf16']:.2f} | {diff:.1e} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("benchmarks/sm90_kernel.py needs a Hopper GPU")
    agree = [] if args.skip_agreement else agreement()
    print("\n| S | D | causal | tiles | Triton TFLOP/s | Gluon | Gluon, other stages | SDPA bf16 | "
          "Gluon/Triton | Gluon/SDPA | rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = speed([int(x) for x in args.seqs.split(",")], [int(x) for x in args.head_dims.split(",")])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sm90_kernel_{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "triton": triton.__version__, "torch": torch.__version__,
                   "agreement": agree, "speed": rows}, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
