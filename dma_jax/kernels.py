"""The CUDA lowering of ``dma_attention``: the Triton kernels through jax-triton.

Four launches per call (six with ``pv="fp8"``), the same kernels the torch
front end runs: the smooth-K mean's partial sums, the dual quantization of Q
and of K (whose programs add the partials up into the mean), for the FP8 P·V
V's channel amax and its transposed E4M3 copy, and the attention kernel (on an
H200 at head_dim 128 with bf16/fp16 P·V the Gluon kernel of
``triton_kernels.attention_sm90``, through ``gluon_call``). jax-triton has no
dtype for float8/E8M0/FP4, so codes and scales travel as uint8.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels import attention as attn
from triton_kernels import attention_sm90 as attn90
from triton_kernels import quantize as quant
from triton_kernels.dma import softmax_fold

from .config import DMAConfig
from .gluon_call import gluon_call


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


def _tile_plan(q_len: int, kv_len: int, q_offset: int, config: DMAConfig):
    """(which of the high and low tiles are native on this GPU, whether any pair is low)."""
    native = attn.native_formats(_capability(), config.low)
    return native, not attn.all_high(q_len, kv_len, q_offset, config.diag_tiles)


def quantize_operands(q, k, v, *, config: DMAConfig, q_offset: int):
    """The launches of one DMA call before the attention kernel (the smooth-K partial
    sums, the dual quantization of Q and of K, V's transposed FP8 copy for ``pv="fp8"``):
    ``(q8, k8, vt, v_scale)``, Q's and K's nine kernel operands each, and V^T and its
    per-channel scale (V itself for both where P·V reads V). The benchmarks time them
    alone."""
    jt = import_jax_triton()
    batch, q_len, _, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    high, low = config.high, config.low
    attn.check_extent(kv_len, kv_heads, dim)
    native, has_lo = _tile_plan(q_len, kv_len, q_offset, config)
    copies = dict(codes=any(native), fp8=not all(native), write_lo=has_lo)

    def channel_partials(x, amax):
        plan = quant.mean_launches(x.shape)
        return jt.triton_call(
            x, x.shape[1], x.shape[2], plan.chunk, kernel=quant._channel_reduce_kernel,
            out_shape=_sds(plan.part_shape, np.float32), grid=plan.grid, D=dim, BLOCK_T=quant.MEAN_BLOCK_T,
            AMAX=amax,
        )

    # Smooth-K: the partial sums (and their number and divisor), which K's
    # quantization adds up into the mean.
    mean = (k, 1, 1)
    if config.smooth_k:
        mean = (channel_partials(k, False), quant.mean_launches(k.shape).n_chunks, kv_len)

    def dual(x, shift, fold, smooth, per_tile):
        return jt.triton_call(
            x, *shift, np.float32(fold), x.shape[1], x.shape[2], kernel=quant._dual_quantize_kernel,
            out_shape=[_sds(s, d) for s, d in quant.quantize_outputs(x.shape, high, low, **copies, per_tile=per_tile)],
            grid=quant.quantize_grid(x.shape, per_tile=per_tile), num_warps=quant.QUANTIZE_WARPS,
            **quant.quantize_meta(dim, high, low, smooth, **copies, per_tile=per_tile,
                                  tile_t=quant.k_tile_tokens(x.shape), fold=fold),
        )

    q8 = dual(q, (q, 1, 1), softmax_fold(config.softmax_scale(dim)), False, False)
    # K's FP8 copies carry one scale per 128-key tile (formats.fp8_per_tile).
    k8 = dual(k, mean, 1.0, config.smooth_k, copies["fp8"])
    vt = v_scale = v
    if config.pv == "fp8":
        vt, v_scale = jt.triton_call(
            v, channel_partials(v, True), kv_len, kv_heads, quant.mean_launches(v.shape).n_chunks,
            kernel=quant._fp8_transpose_kernel,
            out_shape=[_sds((batch, kv_heads, dim, quant.padded_length(kv_len)), np.uint8),
                       _sds((batch, kv_heads, dim), np.float32)],
            grid=quant.transpose_grid(v.shape), D=dim, BLOCK_T=quant.TRANSPOSE_BLOCK_T, HW_CVT=True,
        )
    return q8, k8, vt, v_scale


def attend_operands(q, v, operands, *, causal: bool, config: DMAConfig, q_offset: int):
    """The attention launch of one DMA call on ``quantize_operands``' result
    (``operands``); ``q`` gives the output's shape and dtype."""
    q8, k8, vt, v_scale = operands
    native, has_lo = _tile_plan(q.shape[1], v.shape[1], q_offset, config)
    pv_fp8 = config.pv == "fp8"
    if attn90.applies(_capability(), q.shape[3], jnp.dtype(q.dtype).name, pv_fp8, native):
        batch, q_len, q_heads, dim = q.shape
        n_blocks, block0 = attn.query_blocks(q_len, q_offset, attn90.BLOCK_M)
        return gluon_call(
            *q8[5:], *k8[5:], v, q_len, v.shape[1], q_heads, v.shape[2], q_offset, block0, config.diag_tiles,
            config.sink_tiles, kernel=attn90._dma_attention_sm90_kernel, out_shape=_sds(q.shape, q.dtype),
            grid=(n_blocks, q_heads, batch), num_warps=4, **attn90.launch_meta(dim, causal, has_lo),
        )
    return _attention_call(
        import_jax_triton(), q8, k8, v, vt, v_scale, q=q, causal=causal, q_offset=q_offset,
        diag=config.diag_tiles, sink=config.sink_tiles, qk_scale=1.0,
        launch=attn.launch_config(q.shape[3], causal, pv_fp8, _capability()),
        high=config.high, low=config.low, native=native, has_lo=has_lo, pv_fp8=pv_fp8,
    )


def triton_attention(q, k, v, *, causal: bool, config: DMAConfig, q_offset: int):
    """DMA through the Triton kernels; same contract as ``reference.dma_reference``
    (with ``operands="fp8"`` for the tiles that are not native)."""
    operands = quantize_operands(q, k, v, config=config, q_offset=q_offset)
    return attend_operands(q, v, operands, causal=causal, config=config, q_offset=q_offset)


def triton_input_attention(q, k, v, *, causal: bool, sm_scale: float, q_offset: int):
    """The DMA kernel with Q·Kᵀ on the unquantized inputs: our own bf16/fp16 flash
    attention, one launch, the baseline of ``benchmarks/attention.py``
    (``triton_kernels.attention.input_attention`` is its torch twin). Same shapes
    and ``q_offset`` as ``dma_jax.attention``; no smoothing, no quantization."""
    q_len, dim = q.shape[1], q.shape[3]
    kv_len, kv_heads = k.shape[1], k.shape[2]
    attn.check_extent(kv_len, kv_heads, dim)
    return _attention_call(
        import_jax_triton(), (q,) * 9, (k,) * 9, v, v, v, q=q, causal=causal, q_offset=q_offset,
        diag=attn.band_covering_all(q_len, kv_len, q_offset), sink=0, qk_scale=softmax_fold(sm_scale),
        launch=attn.launch_config(dim, causal, False, _capability(), unquantized=True),
        high="input", low="nvfp4", native=(False, False), has_lo=False, pv_fp8=False,
    )


def _attention_call(jt, q_args, k_args, v, vt, v_scale, *, q, causal: bool, q_offset: int, diag: int, sink: int,
                    qk_scale: float, launch: attn.LaunchConfig, **formats):
    """One ``_dma_attention_kernel`` launch through jax-triton (the twin of the torch
    launcher ``triton_kernels.attention._launch``): the nine Q and nine K operand
    arguments, V, the FP8 P·V's V^T and scale; ``q`` gives the output's shape and dtype;
    ``formats`` are ``attention_meta``'s format switches."""
    batch, q_len, q_heads, dim = q.shape
    kv_len, kv_heads = v.shape[1], v.shape[2]
    n_blocks, block0 = attn.query_blocks(q_len, q_offset, launch.block_m)
    meta = attn.attention_meta(dim, causal=causal, f32_inputs=q.dtype == jnp.float32, interpret=False,
                               launch=launch, **formats)
    return jt.triton_call(
        *q_args, *k_args, v, vt, v_scale, q_len, kv_len, q_heads, kv_heads, q_offset, block0, diag, sink,
        np.float32(qk_scale), kernel=attn._dma_attention_kernel, out_shape=_sds(q.shape, q.dtype),
        grid=(n_blocks, q_heads, batch), num_warps=launch.num_warps, num_stages=launch.num_stages, **meta,
    )
