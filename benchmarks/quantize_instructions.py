"""Instructions per element of the dual-quantize kernel, compiled for sm_90 without a GPU.

The quantizer is bound by its arithmetic (bit-exact rounding in integer operations,
correctly rounded NVFP4 divisions), not by memory: this counts the SASS instructions
of one launch configuration (Triton's ``nvdisasm`` on the cubin) and divides by the
elements each thread quantizes, so a change to the rounding code can be weighed on a
CPU machine. Runs with the CPU venv's Triton 3.9 and with the H200's 3.6 (``pip install
--no-deps --target /tmp/t36lib triton==3.6.0``, then ``PYTHONPATH=/tmp/t36lib:.``), whose
compiles differ by a few instructions. The counts
are static: for the per-token modes that is what runs (no loops), except that each
``div.rn`` left in the PTX also brings a slow-path subroutine that runs only for
extreme operands.

    python benchmarks/quantize_instructions.py [--head-dim 128]
"""

from __future__ import annotations

import argparse
import collections
import re

import triton
from triton.tools.disasm import get_sass

from triton_kernels.aot import compile_launch
from triton_kernels.plan import Buffer, quantize_plan
from triton_kernels.target import Target
from triton_kernels.tuning import QUANTIZE_BLOCK_T, QUANTIZE_WARPS

MODES = {"fp8": dict(codes=False, fp8=True), "codes": dict(codes=True, fp8=False)}


def compiled(head_dim: int, low: str, mode: str) -> dict:
    """The planned dual-quantize launch for Q (no smooth-K, a scale per token) in
    ``mode``, compiled for sm_90: its ``asm`` dict (``ptx``, ``cubin``, ...)."""
    plan = quantize_plan(Buffer("x", (1, 1024, 8, head_dim), "bfloat16"), Target((9, 0)), low=low, fold=0.127,
                         **MODES[mode])
    return compile_launch(plan, plan.launches[-1], {"x": "bfloat16"}, 90)


def sass_opcodes(sass: str) -> collections.Counter:
    """Instructions per opcode (``FFMA.FTZ`` counts as ``FFMA``) in nvdisasm's listing,
    whose instruction lines start with their scheduling control field."""
    counts = collections.Counter()
    for line in sass.splitlines():
        if re.match(r"^[-0-9]{2}:[-0-9]:[-0-9]:[-Y]:[0-9]+\t", line):
            op = re.sub(r"^@!?U?P[0-9T]+\s+", "", line.split("\t", 1)[1]).split()[0]
            counts[op.split(".")[0]] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        raise SystemExit("benchmarks/quantize_instructions.py needs triton >= 3.6 to compile for sm_90 without a GPU")
    per_thread = QUANTIZE_BLOCK_T * args.head_dim // (32 * QUANTIZE_WARPS)
    print(f"sm_90 SASS (Triton {triton.__version__}) of one dual-quantize program: {QUANTIZE_BLOCK_T} tokens x "
          f"head_dim {args.head_dim}, {QUANTIZE_WARPS} warps, {per_thread} elements per thread and format")
    print("| mode | low | SASS instructions | per element | PTX div.rn | PTX E4M3 cvt from f32 | from f16 | most frequent |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for mode in MODES:
        for low in ("nvfp4", "mxfp4"):
            asm = compiled(args.head_dim, low, mode)
            counts = sass_opcodes(get_sass(asm["cubin"]))
            total = sum(counts.values())
            top = ", ".join(f"{op} {n}" for op, n in counts.most_common(5))
            print(f"| {mode} | {low} | {total} | {total / per_thread:.0f} | {asm['ptx'].count('div.rn.f32')} | "
                  f"{asm['ptx'].count('cvt.rn.satfinite.e4m3x2.f32')} | "
                  f"{asm['ptx'].count('cvt.rn.satfinite.e4m3x2.f16x2')} | {top} |")


if __name__ == "__main__":
    main()
