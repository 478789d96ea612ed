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
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

from triton_kernels.quantize import QUANTIZE_BLOCK_T, QUANTIZE_WARPS, _dual_quantize_kernel, quantize_meta

MODES = {"fp8": dict(codes=False, fp8=True), "codes": dict(codes=True, fp8=False)}
_POINTERS = {"x_ptr": "*bf16", "mean_parts": "*fp32", "lo_token": "*fp32", "hi_ts": "*fp32", "lo_ts": "*fp32"}


def compile_sm90(meta: dict, **constants) -> dict:
    """``_dual_quantize_kernel`` compiled for sm_90 with the constexprs ``meta`` and the
    scalar arguments named in ``constants`` specialised to those values (``fold=1`` is
    how jax-triton passes K's fold): its ``asm`` dict (``ptx``, ``cubin``, ...)."""
    names = _dual_quantize_kernel.arg_names
    scalars = {n: t for n, t in dict(n_parts="i32", mean_count="i32", fold="fp32", L="i32", H="i32").items() if n not in constants}
    signature = {n: "constexpr" if n in meta or n in constants else scalars.get(n, _POINTERS.get(n, "*u8"))
                 for n in names}
    # Pointers 16-byte aligned, as torch's allocations are: otherwise every access
    # compiles to byte loads and the count means nothing.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn=_dual_quantize_kernel, signature=signature, constexprs={**meta, **constants}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=QUANTIZE_WARPS)).asm


def compiled(head_dim: int, low: str, mode: str) -> dict:
    """``compile_sm90`` for Q (no smooth-K, a scale per token) in ``mode``."""
    return compile_sm90(quantize_meta(head_dim, "mxfp8_e4m3", low, False, **MODES[mode]))


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
