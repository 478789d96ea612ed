"""The pattern of ``dma_decode`` and ``dma_cache_append``: a JAX primitive whose default
lowering is a jnp body (CPU and any other platform) and whose CUDA lowering runs Triton
kernels through ``executor``, with no gradient (inference only)."""

from __future__ import annotations

from typing import Callable

from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

__all__ = ["kernel_primitive"]


def kernel_primitive(name: str, reference: Callable, executor_function: str, *, multiple_results: bool,
                     public_name: str) -> Primitive:
    """A primitive ``name`` lowered to ``reference`` and, on CUDA, to
    ``executor.<executor_function>`` (imported on first use: Triton loads
    only on GPU machines). Differentiating it raises, naming ``public_name``. The caller
    defines its abstract evaluation."""
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(lambda *args, **params: dispatch.apply_primitive(p, *args, **params))

    def triton_lowering(*args, **params):
        from . import executor

        return getattr(executor, executor_function)(*args, **params)

    mlir.register_lowering(p, mlir.lower_fun(reference, multiple_results=multiple_results))
    mlir.register_lowering(p, mlir.lower_fun(triton_lowering, multiple_results=multiple_results), platform="cuda")

    def no_gradient(*args, **kwargs):
        raise NotImplementedError(f"{public_name} is inference-only: it has no gradient.")

    ad.primitive_jvps[p] = no_gradient
    ad.primitive_transposes[p] = no_gradient
    return p
