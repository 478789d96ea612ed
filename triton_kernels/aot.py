"""Compiling a planned launch ahead of time, without a GPU: for the static checks of
what the compiler emits (MMA kinds in PTX, instruction counts). Needs a Triton that
compiles for the target offline (3.9 on the CPU machine). Imports Triton only."""

from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .plan import Launch, Plan, Scalar

__all__ = ["compile_launch", "signature"]

_POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "uint8": "*u8", "int32": "*i32"}


def signature(plan: Plan, launch: Launch, inputs: dict[str, str],
              specialised: dict[str, Any] | None = None) -> dict[str, str]:
    """Triton's signature of ``launch``, one of ``plan``'s: pointer types of its buffers
    (``inputs``: the call's input names -> dtype names; the plan knows its outputs'),
    scalar types, and "constexpr" for the constexprs and the scalar arguments in
    ``specialised``."""
    dtypes = {**inputs, **{o.name: o.dtype for step in plan.launches for o in step.outputs}}
    kinds = [a.dtype if isinstance(a, Scalar) else _POINTER_TYPES[dtypes[a]] for a in launch.args]
    kinds += [_POINTER_TYPES[o.dtype] for o in launch.outputs]
    names = launch.kernel.arg_names
    sig = dict(zip(names, kinds))
    sig.update((name, "constexpr") for name in [*launch.meta, *(specialised or {})])
    return sig


def compile_launch(plan: Plan, launch: Launch, inputs: dict[str, str], arch: int,
                   specialised: dict[str, Any] | None = None) -> dict[str, Any]:
    """``launch``, one of ``plan``'s, compiled for sm_``arch``; its ``asm`` dict
    (``ptx``, ``cubin``, ...). Every pointer is taken as 16-byte aligned, as the
    frameworks allocate them; ``specialised`` fixes scalar arguments to constants
    (jax-triton and torch pass an integer 1 that way)."""
    sig = signature(plan, launch, inputs, specialised)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(launch.kernel.arg_names)
             if sig[n].startswith("*")}
    src = ASTSource(fn=launch.kernel, signature=sig, constexprs={**launch.meta, **(specialised or {})}, attrs=attrs)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm
