"""The CUDA lowering of ``dma_attention``: the Triton kernels through jax-triton.

Five launches per call, the same kernels the torch front end runs: the
smooth-K mean (partial sums, then their fixed-order total), the dual
quantization of Q and of K, and the attention kernel. jax-triton has no dtype
for float8/E8M0/FP4, so codes and scales travel as uint8.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels import attention as attn
from triton_kernels import quantize as quant
from triton_kernels.dma import softmax_fold

from .config import DMAConfig


def import_jax_triton():
    """Import jax_triton, undoing its blanking of TRITON_CACHE_DIR.

    jax-triton 0.3.1 sets ``TRITON_CACHE_DIR=""`` on import, after which any
    Triton launch from torch in the same process fails with "Could not create
    or locate cache dir"; the previous value (or Triton's default) is restored.
    """
    before = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    finally:  # also when it fails half-way (on a JAX without GPU support)
        if before:
            os.environ["TRITON_CACHE_DIR"] = before
        else:
            os.environ.pop("TRITON_CACHE_DIR", None)
    return jax_triton


def _capability() -> tuple[int, int] | None:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not hasattr(gpus[0], "compute_capability"):
        return None
    major, minor = str(gpus[0].compute_capability).split(".")
    return int(major), int(minor)


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def triton_attention(q, k, v, *, causal: bool, config: DMAConfig, q_offset: int):
    """DMA through the Triton kernels; same contract as ``reference.dma_reference``."""
    jt = import_jax_triton()
    batch, q_len, q_heads, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    high, low = config.high, config.low

    mean = k
    if config.smooth_k:
        grid_sum, grid_mean, part_shape, n_chunks = quant.mean_launches(k.shape)
        parts = jt.triton_call(
            k, kv_len, kv_heads, quant.MEAN_CHUNK, kernel=quant._channel_sum_kernel,
            out_shape=_sds(part_shape, np.float32), grid=grid_sum, D=dim, BLOCK_T=quant.MEAN_BLOCK_T,
        )
        mean = jt.triton_call(
            parts, kv_len, kv_heads, n_chunks, kernel=quant._channel_mean_kernel,
            out_shape=_sds((batch, kv_heads, dim), np.float32), grid=grid_mean, D=dim,
        )

    native = attn.native_formats(_capability(), low)
    values = not all(native)  # the bf16 copies feed the tiles that are not native

    def dual(x, shift, fold, smooth):
        return jt.triton_call(
            x, shift, np.float32(fold), x.shape[1], x.shape[2], kernel=quant._dual_quantize_kernel,
            out_shape=[_sds(s, d) for s, d in quant.quantize_outputs(x.shape, high, low, values)],
            grid=quant.quantize_grid(x.shape), num_warps=quant.QUANTIZE_WARPS,
            **quant.quantize_meta(dim, high, low, smooth, values),
        )

    q8 = dual(q, q, softmax_fold(config.softmax_scale(dim)), False)
    k8 = dual(k, mean, 1.0, config.smooth_k)
    n_tiles, tile0 = attn.query_tiles(q_len, q_offset)
    meta = attn.attention_meta(
        dim, causal=causal, high=high, low=low, native=native,
        v_dtype_is_f32=q.dtype == jnp.float32, interpret=False,
    )
    return jt.triton_call(
        *q8, *k8, v, q_len, kv_len, q_heads, kv_heads, q_offset, tile0,
        config.diag_tiles, config.sink_tiles, kernel=attn._dma_attention_kernel,
        out_shape=_sds(q.shape, q.dtype), grid=(n_tiles, q_heads, batch),
        num_warps=attn.NUM_WARPS, num_stages=attn.NUM_STAGES, **meta,
    )
