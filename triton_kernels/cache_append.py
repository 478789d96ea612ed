"""Writing new tokens into a low-bit KV cache (``dma_jax.kv_cache``) in one launch.

A decode step appends one token per row and layer. Written as array operations, that
is a dozen small launches per layer (smooth-K, rotation, three quantizations, a scatter
per cache array), each far shorter than the time it takes to launch it. This kernel
does all of it where the token is: it reads the new keys and values once, subtracts
the cache's fixed smooth-K mean, rotates, quantizes K into the low format (at the
token's position) and into the high format (at the token's ring slot,
``geometry.cache_slot``; bf16 values for ``high="bf16"``) and V into the cache's value
format, and stores the bytes straight into the cache's arrays, which the executors pass in place (an output that
updates an input, ``plan.Buffer.updates``). The numbers are ``dma_jax.formats``'
bit for bit: the quantization is the quantize kernels' ``_quantize_tile``.

Launched through ``plan``; this module holds kernel code only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mx import BF16_EXP_BITS, mul_flushed, to_bf16
from .quantize import _quantize_tile, _tokens
from .rotation import hadamard_rows


@triton.jit
def _cache_append_kernel(
    k_ptr, v_ptr, mean_ptr, length_ptr,
    _lo_codes_in, _lo_scales_in, _lo_token_in, _hi_codes_in, _hi_scales_in, _v_in, _v_scale_in,
    n, S, R, H, sink_len, ring_len,
    lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v_out, v_scale,
    D: tl.constexpr, BLOCK_T: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr,
    HI_E: tl.constexpr, HI_M: tl.constexpr, HI_EMIN: tl.constexpr, HI_EMAX: tl.constexpr,
    HI_MAX: tl.constexpr, HI_BLOCK: tl.constexpr, HI_RULE: tl.constexpr,
    LO_E: tl.constexpr, LO_M: tl.constexpr, LO_EMIN: tl.constexpr, LO_EMAX: tl.constexpr,
    LO_MAX: tl.constexpr, LO_BLOCK: tl.constexpr, LO_NVFP4: tl.constexpr, LO_RULE: tl.constexpr,
    V_FP8: tl.constexpr, V_E: tl.constexpr, V_M: tl.constexpr, V_EMIN: tl.constexpr, V_EMAX: tl.constexpr,
    V_MAX: tl.constexpr, V_RULE: tl.constexpr, HW_CVT: tl.constexpr,
):
    """One program per (BLOCK_T new tokens, kv head, batch row) of k, v ``[B, n, H, D]``:
    token t of row b goes to position ``length[b] + t`` of the cache's ``S`` positions
    (and to its slot among the ``R`` high copies); positions at or past S are dropped.

    The ``*_in`` pointers are the cache arrays as inputs; the kernel writes their
    outputs, which are the same memory, and leaves every other position alone.
    V_FP8: V in the MX format V_* with a single block of D elements per token (E4M3
    with one E8M0 scale, rule "up": ``formats.quantize_token_e4m3``), else V in the
    cache's dtype."""
    pid_t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = tl.arange(0, D)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    pos = tl.load(length_ptr + b) + t
    keep = (t < n) & (pos < S)
    rows = (b * S + pos) * H + h
    slot = tl.where(pos < sink_len, pos, sink_len + pos % ring_len)
    slot_rows = (b * R + slot) * H + h

    # K as dma_jax.kv_cache forms it: float32, minus the fixed mean, rotated, with
    # subnormals flushed (what dma_jax.formats.quantize does to its input first).
    x = _tokens(k_ptr, n, H, t, b, h, D, n)
    if SMOOTH:
        x = x - tl.load(mean_ptr + (b * H + h) * D + cols)[None, :]
    if ROTATE:
        x = hadamard_rows(x, BLOCK_T, D)
    x = mul_flushed(x, 1.0, HW_CVT, True)
    # The FP8-copy pointers (f8_ptr, ts_ptr) are never touched with WRITE_FP8=False.
    _quantize_tile(x, rows, cols, keep, 1.0, lo_codes, lo_scales, lo_token, lo_codes, lo_token,
                   LO_E, LO_M, LO_EMIN, LO_EMAX, LO_MAX, LO_BLOCK, LO_NVFP4, LO_RULE, BLOCK_T, D,
                   True, False, False, HW_CVT, False)
    if HI_E == BF16_EXP_BITS:  # DMAConfig(high="bf16"): the values themselves
        tl.store(hi_codes + slot_rows[:, None] * D + cols[None, :], to_bf16(x, HW_CVT), mask=keep[:, None])
    else:
        _quantize_tile(x, slot_rows, cols, keep, 1.0, hi_codes, hi_scales, lo_token, hi_codes, lo_token,
                       HI_E, HI_M, HI_EMIN, HI_EMAX, HI_MAX, HI_BLOCK, False, HI_RULE, BLOCK_T, D,
                       True, False, False, HW_CVT, False)

    y = _tokens(v_ptr, n, H, t, b, h, D, n)
    if V_FP8:
        y = mul_flushed(y, 1.0, HW_CVT, True)
        _quantize_tile(y, rows, cols, keep, 1.0, v_out, v_scale, lo_token, v_out, lo_token,
                       V_E, V_M, V_EMIN, V_EMAX, V_MAX, D, False, V_RULE, BLOCK_T, D, True, False, False, HW_CVT,
                       False)
    else:
        tl.store(v_out + rows[:, None] * D + cols[None, :], y.to(v_out.dtype.element_ty), mask=keep[:, None])
