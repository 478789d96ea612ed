"""Launching a Gluon kernel (``triton.experimental.gluon``) from JAX on NVIDIA GPUs.

jax-triton 0.3.1 only launches ``triton.jit`` functions: it compiles them through
Triton's TTIR pipeline with a fixed warp count, while a Gluon kernel starts from
TTGIR and, with ``gl.warp_specialize``, runs more warps than it was launched with.
``gluon_call`` compiles the kernel with Triton's own pipeline (``triton.compile``
on a ``GluonASTSource``) and hands the PTX, total warp count and shared memory to
the launcher jaxlib already has for Triton kernels (the ``triton_kernel_call`` FFI
target, the one jax-triton uses), so it runs inside ``jax.jit`` like any
``triton_call``. Inference only: no differentiation or batching rule.
"""

from __future__ import annotations

import functools
import zlib

import jax
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

_POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "uint8": "*u8", "int32": "*i32"}

gluon_call_p = Primitive("dma_gluon_call")
gluon_call_p.multiple_results = True
gluon_call_p.def_impl(lambda *args, **params: dispatch.apply_primitive(gluon_call_p, *args, **params))


def gluon_call(*args, kernel, out_shape, grid: tuple[int, int, int], num_warps: int = 4, **constexprs):
    """Launch ``kernel[grid](*args, *outputs, **constexprs)``: arrays become pointers,
    Python ints int32 scalars; ``out_shape`` (a ``jax.ShapeDtypeStruct`` or a list of
    them) are allocated and appended, as jax-triton does. ``num_warps``: the warps of
    the kernel's default partition."""
    outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
    arrays, scalars = [], []
    for i, a in enumerate(args):
        if isinstance(a, (int, np.integer)) and not isinstance(a, bool):
            if not -2**31 <= int(a) < 2**31:
                raise ValueError(f"argument {kernel.arg_names[i]} must fit int32; got {a}")
            scalars.append((i, int(a)))
        else:
            arrays.append(a)
    results = gluon_call_p.bind(
        *arrays, kernel=kernel, scalars=tuple(scalars), out_avals=tuple(
            jax.core.ShapedArray(o.shape, o.dtype) for o in outs),
        grid=tuple(grid), num_warps=num_warps, constexprs=tuple(sorted(constexprs.items())))
    return results if isinstance(out_shape, (list, tuple)) else results[0]


@gluon_call_p.def_abstract_eval
def _abstract_eval(*_, out_avals, **__):
    return list(out_avals)


@functools.cache
def _compile(kernel, signature: tuple, constexprs: tuple, num_warps: int, capability: int):
    """The compiled kernel's (name, total warps, shared bytes, PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(signature)
    # Like jax-triton: every array is 16-byte aligned (XLA allocates them so).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if sig.get(name, "").startswith("*")}
    for name, _ in constexprs:
        sig[name] = "constexpr"
    compiled = triton.compile(GluonASTSource(kernel, sig, dict(constexprs), attrs),
                              target=GPUTarget("cuda", capability, 32), options=dict(num_warps=num_warps))
    md = compiled.metadata
    if md.global_scratch_size or getattr(md, "profile_scratch_size", 0):
        raise NotImplementedError(f"{md.name} needs global scratch memory, which jaxlib's launcher does not give")
    return md.name, md.num_warps, md.shared, compiled.asm["ptx"]


def _lowering(ctx, *arrays, kernel, scalars, out_avals, grid, num_warps, constexprs):
    from jax._src.lib import gpu_triton

    capability = gpu_triton.get_compute_capability(0)
    avals = list(ctx.avals_in)
    for i, _ in scalars:
        avals.insert(i, None)
    avals += list(out_avals)
    signature = tuple((name, "i32" if aval is None else _POINTER_TYPES[np.dtype(aval.dtype).name])
                      for name, aval in zip(kernel.arg_names, avals))
    name, total_warps, shared, ptx = _compile(kernel, signature, constexprs, num_warps, capability)
    values = dict(scalars)
    params = [gpu_triton.create_scalar_parameter(values[i], "i32") if aval is None
              else gpu_triton.create_array_parameter(0, 16) for i, aval in enumerate(avals)]
    kernel_obj = gpu_triton.TritonKernel(name, total_warps, 1, shared, ptx, "", capability)
    call = gpu_triton.TritonKernelCall(kernel_obj, *grid, params)
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2,
                                backend_config=zlib.compress(call.to_proto(name, b"")))
    return rule(ctx, *arrays)


mlir.register_lowering(gluon_call_p, _lowering, platform="cuda")
