"""`dma_jax.attention`: DMA as a JAX primitive.

The primitive ``dma_attention`` has an abstract evaluation rule, a CUDA
lowering through the Triton kernels (``triton_call``), a default lowering through
the jnp reference (CPU and any other platform), a batching rule that folds
vmapped axes into the batch axis, and differentiation rules that raise: DMA is
an inference-only forward pass. Both lowerings run per shard when the inputs are
sharded over several devices (``dma_jax.sharding``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .config import DMAConfig
from .reference import dma_reference
from .sharding import partitioned
from .validation import check_attention_inputs, check_prefill_config, resolve_q_offset

__all__ = ["attention", "dma_attention_p"]

dma_attention_p = Primitive("dma_attention")
dma_attention_p.def_impl(lambda *args, **params: dispatch.apply_primitive(
    dma_attention_p, *args, **params))


@dma_attention_p.def_abstract_eval
def _abstract_eval(q, k, v, *, causal, config, q_offset):
    return jax.core.ShapedArray(q.shape, q.dtype)


def _reference_local(q, k, v, causal, config, q_offset):
    return dma_reference(q, k, v, causal=causal, config=config, q_offset=q_offset)


def _triton_local(q, k, v, causal, config, q_offset):
    # Imported on first use: Triton and torch load only on GPU machines.
    from .executor import triton_attention

    return triton_attention(q, k, v, causal=causal, config=config, q_offset=q_offset)


def _lowering(local):
    """A lowering rule that runs ``local`` per shard of sharded inputs (``sharding``)."""
    per_shard = partitioned(local)
    return mlir.lower_fun(
        lambda q, k, v, *, causal, config, q_offset: per_shard(q, k, v, causal, config, q_offset),
        multiple_results=False,
    )


mlir.register_lowering(dma_attention_p, _lowering(_reference_local))
# custom_partitioning's lowering needs the devices the call runs on.
dispatch.prim_requires_devices_during_lowering.add(dma_attention_p)
# NVIDIA GPUs run the Triton kernels instead of the reference.
mlir.register_lowering(dma_attention_p, _lowering(_triton_local), platform="cuda")


def _batch_rule(args, dims, **params):
    """Fold the vmapped axis into the batch axis (axis 0) of q, k and v."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    folded = []
    for x, d in zip(args, dims):
        if d is None:
            x = jnp.broadcast_to(x, (size, *x.shape))
        else:
            x = jnp.moveaxis(x, d, 0)
        folded.append(x.reshape(size * x.shape[1], *x.shape[2:]))
    out = dma_attention_p.bind(*folded, **params)
    return out.reshape(size, -1, *out.shape[1:]), 0


batching.primitive_batchers[dma_attention_p] = _batch_rule


def _no_gradient(*args, **kwargs):
    raise NotImplementedError(
        "dma_jax.attention is inference-only: it has no gradient. For training, "
        "use jax.nn.dot_product_attention or dma_jax.exact_attention."
    )


ad.primitive_jvps[dma_attention_p] = _no_gradient
ad.primitive_transposes[dma_attention_p] = _no_gradient


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    config: DMAConfig | None = None,
    q_offset: int | None = None,
) -> jax.Array:
    """Diagonal-Tiled Mixed-Precision Attention (inference only).

    Works eagerly and inside ``jax.jit`` / ``jax.vmap``. On NVIDIA GPUs it runs
    the Triton kernels; elsewhere the jnp reference, which defines the numerics
    of every backend.

    Args:
      q: ``[batch, q_len, q_heads, head_dim]`` in bf16, fp16 or fp32.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, same dtype;
        ``q_heads % kv_heads == 0`` (MHA, GQA, MQA); head_dim 64 or 128.
      causal: mask keys after each query's absolute position.
      config: :class:`DMAConfig`; default ``DMAConfig()`` (the paper's setting).
      q_offset: absolute position of query row 0; default ``kv_len - q_len``
        (the queries are the last ``q_len`` tokens).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in the input dtype.

    Raises:
      TypeError / ValueError: for inputs outside the supported shapes and dtypes.
      NotImplementedError: when differentiated.
    """
    check_attention_inputs(q, k, v, causal=causal, config=config, q_offset=q_offset)
    check_prefill_config(config)
    if q.shape[0] == 0:  # an empty batch: nothing to compute, on every backend
        return jnp.zeros(q.shape, q.dtype)
    offset = resolve_q_offset(q.shape[1], k.shape[1], q_offset)
    return dma_attention_p.bind(
        q, k, v, causal=causal, config=config or DMAConfig(), q_offset=offset
    )
