"""`dma_jax.decode_attention`: DMA for the newest query rows over a low-bit KV cache.

The primitive ``dma_decode`` has the same structure as ``dma_attention``: a CUDA
lowering through the Triton decode kernels (``triton_kernels.decode``, split over the
keys) and a default lowering in jnp (CPU and any other platform). Its numerics are
those of ``reference_attention`` on the full sequence for the new rows, with the
cache's fixed smooth-K mean: a pair is high or low by the absolute positions of its
query and key, exactly as in prefill.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from triton_kernels.format_table import BF16
from triton_kernels.geometry import CACHE_FIELDS, TILE, cache_slot

from .config import DMAConfig
from .formats import Quantized, dequantize, dequantize_token_e4m3
from .kernel_primitive import kernel_primitive
from .kv_cache import LowBitKVCache
from .reference import _dequantized, pair_is_high, scaled_queries
from .validation import dtype_name

__all__ = ["check_decode_inputs", "decode_attention", "dma_decode_p"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _abstract_eval(q, *cache, config, v_fp8, sink_len, ring_len):
    return jax.core.ShapedArray(q.shape, q.dtype)


def decode_reference(q, lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v, v_scale, length, *,
                     config: DMAConfig, v_fp8: bool, sink_len: int, ring_len: int) -> jax.Array:
    """The jnp body of ``dma_decode``: every cached key decoded to float32, scores in
    both formats chosen per pair, base-2 softmax with P rounded to the input dtype, as
    ``reference.dma_reference``."""
    b, n, hq, d = q.shape
    capacity, hkv = lo_codes.shape[1], lo_codes.shape[2]
    q32 = scaled_queries(q, config)
    hi_rule, lo_rule = config.scale_rules
    groups = hq // hkv

    def grouped(x):
        return x.reshape(b, n, hkv, groups, d)

    k_pos = jnp.arange(capacity)
    k_lo = dequantize(Quantized(lo_codes, lo_scales, lo_token if config.low == "nvfp4" else None), config.low)
    slots = cache_slot(k_pos, sink_len, ring_len)
    if config.high == BF16:
        k_hi = hi_codes[:, slots].astype(jnp.float32)
    else:
        k_hi = dequantize(Quantized(hi_codes[:, slots], hi_scales[:, slots], None), config.high)
    q_pos = (length[:, None] - n + jnp.arange(n)[None, :])[:, None, None, :, None]  # [B, 1, 1, n, 1]

    def scores(fmt, rule, keys):
        qx = grouped(_dequantized(q32, fmt, rule, "exact"))
        return jnp.einsum("bqhgd,bkhd->bhgqk", qx, keys, precision=_HIGHEST)

    high = pair_is_high(q_pos, k_pos, causal=True, config=config)
    s = jnp.where(high, scores(config.high, hi_rule, k_hi), scores(config.low, lo_rule, k_lo))
    s = jnp.where((k_pos <= q_pos) & (k_pos < length[:, None, None, None, None]), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp2(s - jnp.where(m == -jnp.inf, 0.0, m))
    l = jnp.sum(p, axis=-1)
    p = p.astype(q.dtype).astype(jnp.float32)
    values = dequantize_token_e4m3(Quantized(v, v_scale, None)) if v_fp8 else v.astype(jnp.float32)
    o = jnp.einsum("bhgqk,bkhd->bhgqd", p, values, precision=_HIGHEST)
    o = jnp.where(l[..., None] == 0, 0.0, o / l[..., None])
    return jnp.moveaxis(o, (1, 2), (2, 3)).reshape(b, n, hq, d).astype(q.dtype)


dma_decode_p = kernel_primitive("dma_decode", decode_reference, "triton_decode", multiple_results=False,
                                public_name="dma_jax.decode_attention")
dma_decode_p.def_abstract_eval(_abstract_eval)


def decode_attention(q: jax.Array, cache: LowBitKVCache) -> jax.Array:
    """DMA attention of the newest query rows over a :class:`LowBitKVCache`.

    ``q [batch, n, q_heads, head_dim]`` are the queries of each row's last ``n``
    positions, whose keys and values ``cache.append`` has already written (row b's
    query r sits at position ``cache.length[b] - n + r``); causal. The numbers are
    ``reference_attention(q, k, v, q_offset=length - n, k_mean=cache.k_mean,
    config=cache.config)`` on the row's full sequence (with V rounded to E4M3 per token
    for ``v_format="fp8"``), up to float32 summation order. On NVIDIA GPUs it runs the
    split-KV Triton kernel, elsewhere jnp. Works inside ``jax.jit``.

    Returns ``[batch, n, q_heads, head_dim]`` in ``q``'s dtype.
    """
    check_decode_inputs(q, cache)
    sink_len, ring_len = cache.slots
    arrays = [getattr(cache, f) for f in CACHE_FIELDS]
    return dma_decode_p.bind(jnp.asarray(q), *arrays, config=cache.config, v_fp8=cache.v_format == "fp8",
                             sink_len=sink_len, ring_len=ring_len)


def check_decode_inputs(q: Any, cache: LowBitKVCache) -> None:
    """Raise ``TypeError``/``ValueError`` for the first way ``q`` (a JAX, numpy or torch
    array) does not fit a decode step over ``cache``."""
    if not isinstance(cache, LowBitKVCache):
        raise TypeError(f"cache must be a dma_jax.LowBitKVCache; got {type(cache).__name__}")
    shape = tuple(getattr(q, "shape", ()))
    b, _, hkv, half = cache.lo_codes.shape
    d = 2 * half
    if len(shape) != 4 or shape[0] != b or shape[3] != d:
        raise ValueError(f"q must be [batch={b}, n, q_heads, head_dim={d}] for this cache; got {shape}")
    if shape[2] % hkv:
        raise ValueError(f"q_heads must be a multiple of the cache's kv_heads={hkv}; got {shape[2]}")
    if not 1 <= shape[1] <= TILE:
        raise ValueError(f"a decode step takes 1 to {TILE} new query rows; got {shape[1]}")
    if dtype_name(q) != cache.dtype:
        raise TypeError(f"q must have the cache's dtype {cache.dtype}; got {dtype_name(q)}")
