"""An experiment not on main: the Gluon sm_90 kernel made persistent, against main's.

``persistent_sm90.patch`` (next to this file) turns ``triton_kernels/attention_sm90.py``
into a persistent kernel: a 1-D grid of ``programs`` programs (default one per SM)
that each run their share of the n_m × HQ × B query tiles one after the other; the
loader warpgroup copies each tile's Q (both FP8 copies, ``cp.async``) once the
consumers have finished the previous tile's Q·Kᵀ, and keeps filling the K/V ring
across tiles, so that a tile's last P·V and output store overlap the next tile's
first loads. Tiles are dealt in a snake over an order chosen by the constexpr
``ORDER`` (0: query block slowest, longest first when causal; 1: main's order,
(batch, head) slowest; 2: (batch, kv head) slowest, then query block, then the kv
head's query heads). NOTES.md (session 14) has the first measurement and the plan.

This script applies the patch to a temporary copy (main stays as it is), checks that
both kernels give the same output bits on odd shapes (program counts 1 to one per
tile, each order), then times the attention launch alone, back to back, B=1, 32:8
heads, head_dim 128, on the same quantized operands: main's kernel as launched and
with 232 registers per consumer thread and 40 per loader thread (an offline causal
compile spills 116 bytes in the consumers at 216 / 64, none at 232 / 40), the
persistent one with 64 / 80 loader registers and orders 0 / 1 / 2, one tile per
program, and torch's SDPA for scale. Hopper only. Writes
``results/persistent_sm90_<gpu>.json``.

    python benchmarks/experiments/persistent_sm90.py [--seqs 8192,16384]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/
from device_name import gpu_tag  # noqa: E402
from sm90_kernel import back_to_back, operands, rel_l2  # noqa: E402

from triton_kernels import attention_sm90 as main90  # noqa: E402
from triton_kernels.attention import band_covering_all  # noqa: E402


def persistent_module():
    """``attention_sm90`` with the patch applied, as ``triton_kernels.attention_sm90_persistent``."""
    work = tempfile.mkdtemp()
    path = os.path.join(work, "triton_kernels", "attention_sm90.py")
    os.makedirs(os.path.dirname(path))
    shutil.copy(main90.__file__, path)
    patch = os.path.join(HERE, "persistent_sm90.patch")
    if shutil.which("patch"):
        subprocess.run(["patch", "-s", "-p1", "-d", work, "-i", patch], check=True)
    else:  # outside a repository git apply works on plain files
        subprocess.run(["git", "apply", patch], cwd=work, check=True)
    spec = importlib.util.spec_from_file_location("triton_kernels.attention_sm90_persistent", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def agreement(p90, sms: int) -> list[dict]:
    rows = []
    cases = [(2, 300, 300, 8, 2, 0), (1, 200, 700, 4, 4, 500), (1, 129, 1200, 2, 2, 1071), (3, 1000, 1000, 4, 1, 0),
             (1, 2048, 2048, 16, 4, 0)]
    for (b, lq, lk, hq, hkv, off), causal, (diag, sink) in itertools.product(
            cases, (False, True), ((1, 1), (2, 0), (None, 0))):
        g = torch.Generator(device="cuda").manual_seed(lq + lk)
        q, k, v = (torch.randn(b, n, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                   for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
        if diag is None:
            diag = band_covering_all(lq, lk, off)
        has_lo = diag < band_covering_all(lq, lk, off)
        q8, k8 = operands(q, k, has_lo=has_lo)
        kw = dict(q_len=lq, causal=causal, q_offset=off, diag=diag, sink=sink, has_lo=has_lo)
        ref = main90.sm90_attention(q8, k8, v, **kw)
        for programs, order in ((1, 0), (3, 0), (7, 2), (sms, 0), (sms, 1), (sms, 2), (10**6, 1)):
            out = p90.sm90_attention(q8, k8, v, programs=programs, ORDER=order, **kw)
            rows.append(dict(case=[b, lq, lk, hq, hkv, off], causal=causal, diag=diag, sink=sink, programs=programs,
                             order=order, bit_equal=torch.equal(out.view(torch.int16), ref.view(torch.int16)),
                             rel_l2=rel_l2(out, ref)))
    bad = [r for r in rows if not r["bit_equal"]]
    print(f"agreement: {len(rows)} launches, {len(bad)} not bit-equal to main's kernel", flush=True)
    for r in bad:
        print("  differs:", r, flush=True)
    return rows


def speed(p90, seqs) -> list[dict]:
    variants = {  # None: main's kernel with these launch settings; else the persistent one's
        "main": (None, {}),
        "main L40 C232": (None, dict(LOADER_REGS=40, CONSUMER_REGS=232)),
        "pers L64 o0": dict(LOADER_REGS=64, ORDER=0),
        "pers L64 C224 o0": dict(LOADER_REGS=64, CONSUMER_REGS=224, ORDER=0),
        "pers L80 o0": dict(LOADER_REGS=80, ORDER=0),
        "pers L80 o1": dict(LOADER_REGS=80, ORDER=1),
        "pers L80 o2": dict(LOADER_REGS=80, ORDER=2),
        "1 tile/prog L80 o1": dict(LOADER_REGS=80, ORDER=1, programs=10**6),
    }
    print("| S | causal | tiles | " + " | ".join(variants) + " | SDPA bf16 |")
    print("|---|---|---|" + "---:|" * (len(variants) + 1))
    rows = []
    hq, hkv, d = 32, 8, 128
    for s, causal, all_high in itertools.product(seqs, (True, False), (False, True)):
        g = torch.Generator(device="cuda").manual_seed(s)
        q = torch.randn(1, s, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        diag, sink, has_lo = (band_covering_all(s, s, 0), 0, False) if all_high else (1, 1, True)
        q8, k8 = operands(q, k, has_lo=has_lo)
        kw = dict(q_len=s, causal=causal, q_offset=0, diag=diag, sink=sink, has_lo=has_lo)
        fns = {name: (lambda t=t[1]: main90.sm90_attention(q8, k8, v, **t, **kw)) if isinstance(t, tuple)
               else (lambda t=t: p90.sm90_attention(q8, k8, v, **t, **kw)) for name, t in variants.items()}
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        fns["SDPA bf16"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        ms = {}
        for _ in range(2):  # two interleaved passes, the faster median of each
            for name, fn in fns.items():
                ms[name] = min(ms.get(name, float("inf")), back_to_back(fn))
        flops = 4 * s * s * hq * d / (2 if causal else 1)
        tf = {name: flops / t / 1e9 for name, t in ms.items()}
        tiles = "all high" if all_high else "default"
        rows.append(dict(seq=s, causal=causal, tiles=tiles, ms=ms, tflops=tf))
        print(f"| {s} | {causal} | {tiles} | " + " | ".join(f"{tf[n]:.0f}" for n in fns) + " |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("benchmarks/experiments/persistent_sm90.py needs a Hopper GPU")
    p90 = persistent_module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    agree = agreement(p90, sms)
    rows = speed(p90, [int(x) for x in args.seqs.split(",")])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"persistent_sm90_{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "agreement": agree, "speed": rows}, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
