"""The DMA decode kernels: a few new query rows against a low-bit KV cache
(``dma_jax.kv_cache``), split over the keys, then the splits combined.

Decode is memory-bound: each key is read once per step, and a 4-bit key row is a
quarter of a bf16 one. So the kernel reads the cache's codes and decodes them in
registers (integer arithmetic, ``mx.element_value``); there is no FP8 copy to make.
Decoded operands are exact in bf16: an MX value is a 2-4 bit significand times a
power of two, NVFP4's ``e · sb`` has at most 6 significant bits, and NVFP4's per-token
``s2`` multiplies the scores afterwards. Products of bf16 values are exact in the
fp32 accumulator, so the scores are the reference's up to summation order.

One program per (key split, kv head, batch row) takes every query head of its kv head
(GQA by indexing) and every new row: ``BLOCK_M >= GROUP * n_q`` rows, row
``m = r * GROUP + g`` being query row ``r`` of head ``kv_head * GROUP + g``. Each row's
absolute position is ``length - n_q + r`` (``length``: the row's filled positions,
after this step's keys were appended). The keys of a split are cut into runs whose
format is a compile-time constant (``_decode_run``): the sink tiles (high), the far
keys (low), at most one tile that is high for the earlier rows only (both formats,
chosen per row), and the band (high). High copies live in a ring of slots
(``geometry.cache_slots``). Each program writes its unnormalised output, row maxima
and row sums; ``_decode_combine_kernel`` merges the splits in split order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .geometry import TILE
from .mx import element_value, pow2, round_to_bf16

_TILE = tl.constexpr(TILE)

# Run modes of _decode_run.
_LOW = tl.constexpr(0)
_HIGH = tl.constexpr(1)
_BOTH = tl.constexpr(2)


@triton.jit
def _decode_values(codes_ptr, scales_ptr, token_ptr, rows, mask, D: tl.constexpr, R: tl.constexpr,
                   EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, BLOCK: tl.constexpr, NV: tl.constexpr):
    """Rows ``rows`` (int64 indices into the token grid) of a quantized operand as
    float32 ``[R, D]`` values ``e · scale`` (exact in bf16), and the per-row factor:
    NVFP4's ``s2``, else 1. 4-bit codes are packed two per byte, element ``2t`` in the
    low nibble. A NaN scale (a non-finite block) decodes to NaN."""
    if EXP_BITS + MAN_BITS == 3:
        cols = tl.arange(0, D // 2)
        packed = tl.load(codes_ptr + rows[:, None] * (D // 2) + cols[None, :], mask=mask[:, None], other=0)
        packed = packed.to(tl.int32)
        low = element_value(packed & 0xF, EXP_BITS, MAN_BITS)
        high = element_value(packed >> 4, EXP_BITS, MAN_BITS)
        values = tl.reshape(tl.join(low, high), (R, D))
    else:
        cols = tl.arange(0, D)
        codes = tl.load(codes_ptr + rows[:, None] * D + cols[None, :], mask=mask[:, None], other=0)
        values = element_value(codes.to(tl.int32), EXP_BITS, MAN_BITS)
    blocks = tl.arange(0, D // BLOCK)
    sc = tl.load(scales_ptr + rows[:, None] * (D // BLOCK) + blocks[None, :], mask=mask[:, None], other=0)
    sc = sc.to(tl.int32)
    if NV:
        # Unsigned E4M3 block scales; 0x7F marks a non-finite block.
        scale = tl.where(sc == 0x7F, float("nan"), element_value(sc, 4, 3))
        token = tl.load(token_ptr + rows, mask=mask, other=1.0)
    else:
        # E8M0: 2^(s - 127), 0xFF = NaN. s = 0 (2^-127, a float32 subnormal) reads as
        # 2^-126: only blocks of magnitude ~1e-38 differ, whose scores are ~0 either way.
        scale = tl.where(sc == 0xFF, float("nan"), pow2(tl.maximum(sc - 127, -126)))
        token = tl.full((R,), 1.0, tl.float32)
    values = tl.reshape(tl.reshape(values, (R, D // BLOCK, BLOCK)) * scale[:, :, None], (R, D))
    return values, token


@triton.jit
def _operand(values, DOT_F32: tl.constexpr):
    """Decoded values as a ``tl.dot`` operand: bf16 (exact), or float32 in the
    interpreter, whose bf16 ``tl.dot`` is wrong."""
    if DOT_F32:
        return values
    else:
        return values.to(tl.bfloat16)


@triton.jit
def _scores(qa, qt, k_codes, k_scales, k_token, k_rows, t_ok, D: tl.constexpr, BLOCK_N: tl.constexpr,
            EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, BLOCK: tl.constexpr, NV: tl.constexpr,
            DOT_F32: tl.constexpr):
    """Base-2 scores ``[BLOCK_M, BLOCK_N]`` of the prepared Q operand ``qa`` (row
    factors ``qt``) against the keys at ``k_rows`` in one format."""
    kv, kt = _decode_values(k_codes, k_scales, k_token, k_rows, t_ok, D, BLOCK_N, EXP_BITS, MAN_BITS, BLOCK, NV)
    if DOT_F32:
        s = tl.dot(qa, tl.trans(kv), input_precision="ieee")
    else:
        s = tl.dot(qa, tl.trans(_operand(kv, False)), out_dtype=tl.float32)
    if NV:
        s = (s * qt[:, None]) * kt[None, :]
    return s


@triton.jit
def _decode_run(
    acc, m_i, l_i, q_hi, q_hi_t, q_lo, q_lo_t, row_high, q_pos,
    lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v_ptr, v_scale,
    b, hkv, S, R, HKV, length, sink_len, ring_len, start, stop,
    MODE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    HI_E: tl.constexpr, HI_M: tl.constexpr, LO_M: tl.constexpr, LO_BLOCK: tl.constexpr, LO_NV: tl.constexpr,
    V_FP8: tl.constexpr, P_DTYPE: tl.constexpr, PV_F32: tl.constexpr, DOT_F32: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """Online base-2 softmax over keys [start, stop) (``start`` a multiple of BLOCK_N,
    which divides TILE) in one MODE: low copies, high copies, or both with the format
    chosen per row (``row_high``). Every block is masked: key < length and, causally,
    key <= the row's position."""
    offs = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    for n0 in range(start, stop, BLOCK_N):
        t = n0 + offs
        t_ok = t < length
        if MODE != _HIGH:
            rows = (b * S + t).to(tl.int64) * HKV + hkv
            s_lo = _scores(q_lo, q_lo_t, lo_codes, lo_scales, lo_token, rows, t_ok, D, BLOCK_N, 2, LO_M, LO_BLOCK,
                           LO_NV, DOT_F32)
        if MODE != _LOW:
            # A block lies inside one tile, and tiles map to consecutive slots.
            slot0 = tl.where(n0 < sink_len, n0, sink_len + n0 % ring_len)
            rows = (b * R + slot0 + offs).to(tl.int64) * HKV + hkv
            s_hi = _scores(q_hi, q_hi_t, hi_codes, hi_scales, hi_codes, rows, t_ok, D, BLOCK_N, HI_E, HI_M, 32,
                           False, DOT_F32)
        if MODE == _LOW:
            s = s_lo
        elif MODE == _HIGH:
            s = s_hi
        else:
            s = tl.where(row_high[:, None], s_hi, s_lo)
        valid = t_ok[None, :] & (t[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no valid key keeps m = -inf: use 0 so that P = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = (b * S + t).to(tl.int64) * HKV + hkv
        if V_FP8:
            # E4M3 values with one E8M0 scale per token: exact in bf16.
            codes = tl.load(v_ptr + v_rows[:, None] * D + cols[None, :], mask=t_ok[:, None], other=0)
            vs = tl.load(v_scale + v_rows, mask=t_ok, other=127).to(tl.int32)
            v = element_value(codes.to(tl.int32), 4, 3) * pow2(tl.maximum(vs - 127, -126))[:, None]
            v = tl.where((vs == 0xFF)[:, None], float("nan"), v)
        else:
            v = tl.load(v_ptr + v_rows[:, None] * D + cols[None, :], mask=t_ok[:, None], other=0.0)
        # P is rounded to the input dtype before P·V, as in the prefill kernel and the
        # reference; the row sum above uses the unrounded P.
        if P_DTYPE == "bfloat16":
            if FIX_BF16:
                p_in = round_to_bf16(p).to(tl.bfloat16)
            else:
                p_in = p.to(tl.bfloat16)
        elif P_DTYPE == "float16":
            p_in = p.to(tl.float16)
        else:
            p_in = p
        if PV_F32:
            pv = tl.dot(p_in.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_in, v.to(p_in.dtype), out_dtype=tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prepare_q(codes_ptr, scales_ptr, token_ptr, rows, mask, D: tl.constexpr, BLOCK_M: tl.constexpr,
               EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, BLOCK: tl.constexpr, NV: tl.constexpr,
               DOT_F32: tl.constexpr):
    qv, qt = _decode_values(codes_ptr, scales_ptr, token_ptr, rows, mask, D, BLOCK_M, EXP_BITS, MAN_BITS, BLOCK, NV)
    return _operand(qv, DOT_F32), qt


@triton.jit
def _dma_decode_kernel(
    q_hi_codes, q_hi_scales, q_lo_codes, q_lo_scales, q_lo_token,
    lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v_ptr, v_scale, lengths,
    n_q, S, R, HQ, HKV, sink_len, ring_len, diag, sink, split_len,
    o_acc, o_m, o_l,
    D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HI_E: tl.constexpr, HI_M: tl.constexpr, LO_M: tl.constexpr, LO_BLOCK: tl.constexpr, LO_NV: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, V_FP8: tl.constexpr, P_DTYPE: tl.constexpr,
    PV_F32: tl.constexpr, DOT_F32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    split = tl.program_id(0)
    hkv = tl.program_id(1)
    b = tl.program_id(2)
    n_split = tl.num_programs(0)
    length = tl.load(lengths + b)

    m_rows = tl.arange(0, BLOCK_M)
    r = m_rows // GROUP
    m_ok = r < n_q
    q_rows = ((b * n_q + r) * HQ + hkv * GROUP + m_rows % GROUP).to(tl.int64)
    q_pos = length - n_q + r
    if HAS_HI:
        q_hi, q_hi_t = _prepare_q(q_hi_codes, q_hi_scales, q_hi_codes, q_rows, m_ok, D, BLOCK_M, HI_E, HI_M, 32,
                                  False, DOT_F32)
    else:
        q_hi, q_hi_t = tl.zeros((BLOCK_M, D), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
    if HAS_LO:
        q_lo, q_lo_t = _prepare_q(q_lo_codes, q_lo_scales, q_lo_token, q_rows, m_ok, D, BLOCK_M, 2, LO_M, LO_BLOCK,
                                  LO_NV, DOT_F32)
    else:
        q_lo, q_lo_t = q_hi, q_hi_t

    # Key tile t is high for row r when t < sink or (row tile) - t < diag: the band
    # starts at tile (row tile) - diag + 1, later for later rows.
    first_tile = (length - n_q) // _TILE
    last_tile = (length - 1) // _TILE
    sink_end = tl.minimum(sink * _TILE, length)
    if HAS_LO and HAS_HI:
        both_start = tl.maximum(tl.minimum((first_tile - diag + 1) * _TILE, length), sink_end)
        band_start = tl.maximum(tl.minimum((last_tile - diag + 1) * _TILE, length), both_start)
    elif HAS_HI:
        sink_end = length
        both_start = length
        band_start = length
    else:
        sink_end = 0
        both_start = length
        band_start = length
    # Rows of the mixed tile (at most one: both_start .. band_start) that are high.
    row_high = ((q_pos // _TILE) - both_start // _TILE) < diag

    lo = split * split_len
    hi = tl.minimum(lo + split_len, length)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    # The runs in key order: sink (high), far (low), the mixed tile, the band (high).
    acc, m_i, l_i = _decode_run(
        acc, m_i, l_i, q_hi, q_hi_t, q_lo, q_lo_t, row_high, q_pos, lo_codes, lo_scales, lo_token, hi_codes,
        hi_scales, v_ptr, v_scale, b, hkv, S, R, HKV, length, sink_len, ring_len, lo, tl.minimum(sink_end, hi),
        _HIGH, D, BLOCK_N, HI_E, HI_M, LO_M, LO_BLOCK, LO_NV, V_FP8, P_DTYPE, PV_F32, DOT_F32, FIX_BF16)
    acc, m_i, l_i = _decode_run(
        acc, m_i, l_i, q_hi, q_hi_t, q_lo, q_lo_t, row_high, q_pos, lo_codes, lo_scales, lo_token, hi_codes,
        hi_scales, v_ptr, v_scale, b, hkv, S, R, HKV, length, sink_len, ring_len, tl.maximum(sink_end, lo),
        tl.minimum(both_start, hi),
        _LOW, D, BLOCK_N, HI_E, HI_M, LO_M, LO_BLOCK, LO_NV, V_FP8, P_DTYPE, PV_F32, DOT_F32, FIX_BF16)
    acc, m_i, l_i = _decode_run(
        acc, m_i, l_i, q_hi, q_hi_t, q_lo, q_lo_t, row_high, q_pos, lo_codes, lo_scales, lo_token, hi_codes,
        hi_scales, v_ptr, v_scale, b, hkv, S, R, HKV, length, sink_len, ring_len, tl.maximum(both_start, lo),
        tl.minimum(band_start, hi),
        _BOTH, D, BLOCK_N, HI_E, HI_M, LO_M, LO_BLOCK, LO_NV, V_FP8, P_DTYPE, PV_F32, DOT_F32, FIX_BF16)
    acc, m_i, l_i = _decode_run(
        acc, m_i, l_i, q_hi, q_hi_t, q_lo, q_lo_t, row_high, q_pos, lo_codes, lo_scales, lo_token, hi_codes,
        hi_scales, v_ptr, v_scale, b, hkv, S, R, HKV, length, sink_len, ring_len, tl.maximum(band_start, lo), hi,
        _HIGH, D, BLOCK_N, HI_E, HI_M, LO_M, LO_BLOCK, LO_NV, V_FP8, P_DTYPE, PV_F32, DOT_F32, FIX_BF16)
    out = ((b * HKV + hkv) * n_split + split).to(tl.int64) * BLOCK_M + m_rows
    cols = tl.arange(0, D)
    tl.store(o_acc + out[:, None] * D + cols[None, :], acc)
    tl.store(o_m + out, m_i)
    tl.store(o_l + out, l_i)


@triton.jit
def _decode_combine_kernel(o_acc, o_m, o_l, n_q, HQ, HKV, n_split, out_ptr,
                           D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the splits of one (kv head, batch row) in split order and write
    ``out [B, n_q, HQ, D]``; a row without any valid key is 0."""
    hkv = tl.program_id(0)
    b = tl.program_id(1)
    m_rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    base = (b * HKV + hkv).to(tl.int64) * n_split * BLOCK_M
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in range(n_split):
        m = tl.maximum(m, tl.load(o_m + base + s * BLOCK_M + m_rows))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    for s in range(n_split):
        rows = base + s * BLOCK_M + m_rows
        w = tl.exp2(tl.load(o_m + rows) - m_safe)
        l += w * tl.load(o_l + rows)
        acc += w[:, None] * tl.load(o_acc + rows[:, None] * D + cols[None, :])
    o = tl.where((l == 0.0)[:, None], 0.0, acc / l[:, None])
    r = m_rows // GROUP
    q_rows = ((b * n_q + r) * HQ + hkv * GROUP + m_rows % GROUP).to(tl.int64)
    tl.store(out_ptr + q_rows[:, None] * D + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=(r < n_q)[:, None])
