"""Compiling planned launches with Triton's own pipeline (``triton.compile``) for a
given GPU: the JAX executor's kernels (``dma_jax.triton_call``), and ahead of time
without a GPU for the static checks of what the compiler emits (MMA kinds in PTX,
registers, spills, shared memory; offline compilation needs Triton 3.9 on the CPU
machine). Imports Triton only (and runs the ptxas it ships)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .plan import Launch, Plan, Scalar

__all__ = ["block_scaled_mmas", "compile_kernel", "compile_launch", "compile_source", "launcher_specialisation",
           "ptxas_usage", "signature", "wgmma_kinds"]

_POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "uint8": "*u8", "int32": "*i32"}


def signature(launch: Launch, dtypes: dict[str, str], specialised: dict[str, Any] | None = None) -> dict[str, str]:
    """Triton's signature of ``launch``: pointer types of its buffers (``dtypes``: buffer
    name -> dtype name, for its inputs and outputs), scalar types, and "constexpr" for
    the constexprs and the scalar arguments in ``specialised``."""
    kinds = [a.dtype if isinstance(a, Scalar) else _POINTER_TYPES[dtypes[a]] for a in launch.args]
    kinds += [_POINTER_TYPES[o.dtype] for o in launch.outputs]
    sig = dict(zip(launch.kernel.arg_names, kinds))
    sig.update((name, "constexpr") for name in [*launch.meta, *(specialised or {})])
    return sig


def launcher_specialisation(launch: Launch) -> tuple[dict[str, int], tuple[str, ...]]:
    """What Triton's launcher makes of ``launch``'s scalar arguments, as it does on every
    call (``native_specialize_impl``): an integer 1 becomes the constant 1, and integers
    that are multiples of 16 are compiled as known to be; floats stay arguments.
    Returns (the constants by name, the names of the multiples of 16)."""
    names = launch.kernel.arg_names
    ints = {n: int(a.value) for n, a in zip(names, launch.args) if isinstance(a, Scalar) and a.dtype == "i32"}
    return {n: 1 for n, v in ints.items() if v == 1}, tuple(n for n, v in ints.items() if v != 1 and v % 16 == 0)


def compile_source(kernel: Any, sig: dict[str, str], constexprs: dict[str, Any], arch: int, *, num_warps: int,
                   num_stages: int, gluon: bool = False, divisible: tuple[str, ...] = ()) -> Any:
    """``kernel`` (a ``triton.jit`` function, or a ``gluon.jit`` one with ``gluon``)
    compiled for sm_``arch`` with signature ``sig`` (``signature``) and ``constexprs``.
    Every pointer is taken as 16-byte aligned (the frameworks allocate them so) and the
    integer arguments named in ``divisible`` as multiples of 16. A Gluon kernel lays out
    its own pipeline, so it takes no ``num_stages``."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig.get(n, "").startswith("*") or n in divisible}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, sig, constexprs, attrs)
        options = dict(num_warps=num_warps)
    else:
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
        options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_kernel(plan: Plan, launch: Launch, inputs: dict[str, str], arch: int,
                   specialised: dict[str, Any] | None = None) -> Any:
    """``launch``, one of ``plan``'s, compiled for sm_``arch`` (Triton's compiled
    kernel: ``asm`` with ``ptx`` and ``cubin``, ``metadata`` with ``shared``);
    ``specialised`` fixes scalar arguments to constants (Triton specialises an integer 1
    that way)."""
    dtypes = {**inputs, **{o.name: o.dtype for step in plan.launches for o in step.outputs}}
    return compile_source(launch.kernel, signature(launch, dtypes, specialised),
                          {**launch.meta, **(specialised or {})}, arch, num_warps=launch.num_warps,
                          num_stages=launch.num_stages, gluon=launch.gluon)


def compile_launch(plan: Plan, launch: Launch, inputs: dict[str, str], arch: int,
                   specialised: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``asm`` dict (``ptx``, ``cubin``, ...) of ``compile_kernel``."""
    return compile_kernel(plan, launch, inputs, arch, specialised).asm


def block_scaled_mmas(ptx: str) -> list[tuple[str, str, str]]:
    """The block-scaled ``tcgen05.mma`` instructions in ``ptx`` as (kind, scale block,
    scale type), sorted and without repeats. The scale type is bit 23 of the instruction
    descriptor, an immediate moved into the register the MMA reads (PTX ISA, tcgen05
    instruction descriptor: 1 = UE8M0, and for kind::mxf4nvf4 0 = UE4M3); "?" where the
    descriptor is not such an immediate."""
    constants = dict(re.findall(r"mov[.]b32 \t(%r[0-9]+), (-?[0-9]+);", ptx))
    found = set()
    for kind, block, reg in re.findall(r"tcgen05[.]mma[.]cta_group::1[.]kind::([a-z0-9]+)[.]block_scale[.]"
                                       r"([a-z0-9]+) \[[^]]*\], (?:\[[^]]*\]|%rd[0-9]+), %rd[0-9]+, (%r[0-9]+),",
                                       ptx):
        scale = "?" if reg not in constants else "ue8m0" if int(constants[reg]) >> 23 & 1 else "ue4m3"
        found.add((kind, block, scale))
    return sorted(found)


def wgmma_kinds(ptx: str) -> list[str]:
    """The input types of the ``wgmma`` instructions in ``ptx`` (sm_90), sorted."""
    return sorted(set(re.findall(r"wgmma[.]mma_async[.]sync[.]aligned[.]m64n[0-9]+k[0-9]+[.]f32[.]([a-z0-9]+)[.]", ptx)))


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers per thread, spill stores and loads (bytes) and static shared memory
    that ptxas reports for ``ptx`` (assembled for the target its ``.target`` line names,
    with the ptxas Triton ships for it)."""
    found = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    if found is None:
        raise ValueError("no .target line in the PTX")
    target = found.group(1)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # Triton 3.9 ships the newer ptxas as ptxas-blackwell; its PTX version needs it.
    ptxas = next(p for p in (os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        done = subprocess.run([ptxas, "-v", "--gpu-name", target, src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stderr + done.stdout

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"),
            "shared_static": number(r"(\d+) bytes smem")}
