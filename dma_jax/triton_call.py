"""Launching the plans' Triton kernels (``triton.jit`` and Gluon) from JAX on NVIDIA GPUs.

``triton_call`` stages one launch as a JAX primitive. Its CUDA lowering compiles the
kernel with Triton's own pipeline (``triton_kernels.aot.compile_source``, the
``triton.compile`` that Triton's launcher, and so the torch executor, runs too) and
hands the PTX to the launcher jaxlib has for Triton kernels, through its FFI custom
call ``triton_kernel_call_ffi``: XLA prepares each call once per executable and may
record it into a command buffer (a CUDA graph) with its neighbours. jaxlib's older
custom call, ``triton_kernel_call`` (jax-triton 0.3.1's), finds the kernel on every
call by hashing its whole compressed PTX and TTIR. Inference only: no
differentiation or batching rule.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import jax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

__all__ = ["triton_call"]

triton_call_p = Primitive("dma_triton_call")
triton_call_p.multiple_results = True
triton_call_p.def_impl(lambda *args, **params: dispatch.apply_primitive(triton_call_p, *args, **params))


def triton_call(*arrays: Any, kernel: Any, signature: dict[str, str], constexprs: dict[str, Any],
                scalars: dict[str, Any], out_shape: list[jax.ShapeDtypeStruct], grid: tuple[int, int, int],
                num_warps: int, num_stages: int, gluon: bool = False, divisible: tuple[str, ...] = (),
                aliases: dict[int, int] | None = None) -> list[jax.Array]:
    """Launch ``kernel[grid]`` on ``arrays`` (its pointer arguments in order, the
    outputs' last): ``signature`` is Triton's (``aot.signature``), ``scalars`` the
    values of its scalar arguments by name, ``divisible`` those known to be multiples
    of 16, ``out_shape`` the outputs to allocate; ``aliases`` maps an input array's
    index to the output that updates it in place."""
    for name, value in scalars.items():
        if signature[name] == "i32" and not -2**31 <= value < 2**31:
            raise ValueError(f"argument {name} of {kernel.fn.__name__} must fit int32; got {value}")
    results = triton_call_p.bind(
        *arrays, kernel=kernel, signature=tuple(signature.items()), constexprs=tuple(sorted(constexprs.items())),
        scalars=tuple(sorted(scalars.items())),
        out_avals=tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_shape), grid=tuple(grid),
        num_warps=num_warps, num_stages=num_stages, gluon=gluon, divisible=tuple(divisible),
        aliases=tuple(sorted((aliases or {}).items())))
    return list(results)


@triton_call_p.def_abstract_eval
def _abstract_eval(*_, out_avals, **__):
    return list(out_avals)


@functools.cache
def _compile(kernel: Any, signature: tuple, constexprs: tuple, arch: int, num_warps: int, num_stages: int,
             gluon: bool, divisible: tuple) -> tuple[str, int, int, str]:
    """The compiled kernel's (name, total warps, shared bytes, PTX)."""
    from triton_kernels.aot import compile_source

    compiled = compile_source(kernel, dict(signature), dict(constexprs), arch, num_warps=num_warps,
                              num_stages=num_stages, gluon=gluon, divisible=divisible)
    md = compiled.metadata
    if md.global_scratch_size or getattr(md, "profile_scratch_size", 0):
        raise NotImplementedError(f"{md.name} needs global scratch memory, which jaxlib's launcher does not give")
    # A warp-specialised Gluon kernel runs more warps than its default partition's.
    return md.name, md.num_warps, md.shared, compiled.asm["ptx"]


def _lowering(ctx, *arrays, kernel, signature, constexprs, scalars, out_avals, grid, num_warps, num_stages, gluon,
              divisible, aliases):
    from jax._src.lib import gpu_triton

    arch = gpu_triton.get_compute_capability(0)
    name, total_warps, shared, ptx = _compile(kernel, signature, constexprs, arch, num_warps, num_stages, gluon,
                                              divisible)
    values = dict(scalars)
    # Triton's kernel parameters: every argument but the constexprs, in order.
    params = [gpu_triton.create_array_parameter(0, 16) if kind.startswith("*")
              else gpu_triton.create_scalar_parameter(values[arg], kind)
              for arg, kind in signature if kind != "constexpr"]
    call = gpu_triton.TritonKernelCall(gpu_triton.TritonKernel(name, total_warps, 1, shared, ptx, "", arch), *grid,
                                       params)
    rule = jax.ffi.ffi_lowering("triton_kernel_call_ffi", api_version=4, operand_output_aliases=dict(aliases))
    return rule(ctx, *arrays, opaque=zlib.compress(call.to_proto(name, b"")))


mlir.register_lowering(triton_call_p, _lowering, platform="cuda")
