"""The DMA decode kernels: a few new query rows against a low-bit KV cache
(``dma_jax.kv_cache``), split over the keys, then the splits combined.

Decode is memory-bound: each key is read once per step, and a 4-bit key row is a
quarter of a bf16 one. So the kernel reads the cache's codes and decodes them in
registers (integer arithmetic, ``mx.element_value``); there is no FP8 copy to make.
Decoded operands are exact in bf16: an MX value is a 2-4 bit significand times a
power of two, NVFP4's ``e · sb`` has at most 6 significant bits, and NVFP4's per-token
``s2`` multiplies the scores afterwards; ``DMAConfig(high="bf16")``'s copies are bf16
values already. Products of bf16 values are exact in the
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
from .mx import BF16_EXP_BITS, e4m3_value, element_value, pow2, to_bf16

_TILE = tl.constexpr(TILE)

# Run modes of _decode_run.
_LOW = tl.constexpr(0)
_HIGH = tl.constexpr(1)
_BOTH = tl.constexpr(2)


@triton.jit
def _as_operand(x, DOT_F32: tl.constexpr):
    """Exact float32 values as a ``tl.dot`` operand: bf16, or float32 in the
    interpreter, whose bf16 ``tl.dot`` is wrong."""
    if DOT_F32:
        return x
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _e2m1(nibbles, LIFTED: tl.constexpr, DOT_F32: tl.constexpr):
    """E2M1 codes (int32 in [0, 15]) as bf16 values (float32 with DOT_F32), built from
    their bits without float arithmetic.

    LIFTED: the code's three magnitude bits moved into the low exponent bits and the top
    mantissa bit, ``(c & 7) << 6``, with the sign at bit 15. That is the value times
    2^-126 for every code: magnitude codes 0 and 1 (0 and 0.5) land on the subnormals
    0 and 2^-127, and code c >= 2 has exponent ``c // 2`` and mantissa bit ``c & 1``.
    Two bit moves per nibble, no compare; ``_low_keys`` and the kernel's lift of Q undo
    the factor. Otherwise the exact value: 0 and 0.5 are ``code * 0x3F00``, code c >= 2
    has exponent ``126 + c // 2``, which is ``(c + 252) << 6``."""
    if LIFTED:
        bits = ((nibbles & 7) << 6) | ((nibbles & 8) << 12)
    else:
        mag = nibbles & 7
        bits = tl.where(mag < 2, mag * 0x3F00, (mag + 252) << 6) | ((nibbles & 8) << 12)
    if DOT_F32:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _nibbles(packed, LIFTED: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    """The low and the high nibbles of 4-bit code bytes ``packed`` (uint8) as ``_e2m1``
    values. Lifted on a GPU: PTX on four bytes at a time, which spreads two bytes into the
    two bf16 halves of a register (``prmt``) and moves each nibble's bits there with
    shifts and masks, 18 instructions for eight values."""
    if LIFTED and HW_CVT and not DOT_F32:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, a, b;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            shl.b32 a, t0, 6;  shl.b32 b, t0, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 $0, a, b;
            shl.b32 a, t1, 6;  shl.b32 b, t1, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
            shl.b32 a, t0, 2;  shl.b32 b, t0, 8;  and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 $2, a, b;
            shl.b32 a, t1, 2;  shl.b32 b, t1, 8;  and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 $3, a, b;
            }""",
            "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        packed = packed.to(tl.int32)
        return _e2m1(packed & 0xF, LIFTED, DOT_F32), _e2m1(packed >> 4, LIFTED, DOT_F32)


@triton.jit
def _fp8(codes, EXP_BITS: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    """E4M3 / E5M2 bytes as bf16 values (float32 with DOT_F32): the GPU's conversion
    (exact), or integer decoding in the interpreter."""
    if HW_CVT:
        if EXP_BITS == 4:
            x = codes.to(tl.float8e4nv, bitcast=True)
        else:
            x = codes.to(tl.float8e5, bitcast=True)
        if DOT_F32:
            return x.to(tl.float32)
        else:
            return x.to(tl.bfloat16)
    else:
        return _as_operand(element_value(codes.to(tl.int32), EXP_BITS, 7 - EXP_BITS), DOT_F32)


@triton.jit
def _e4m3_lifted(bytes_, DOT_F32: tl.constexpr):
    """E4M3 bytes (int32 in [0, 255]) lifted: the seven magnitude bits moved under
    bf16's exponent, ``(b & 0x7F) << 4``, the sign to bit 15. That is the value times
    2^-120 for every finite code (subnormals included: exponent field 0 stays 0), from
    bit moves only (float32 with DOT_F32: the same bits 16 places up)."""
    bits = ((bytes_ & 0x7F) << 4) | ((bytes_ & 0x80) << 8)
    if DOT_F32:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_words(v_ptr, rows, mask, D: tl.constexpr, LIFTED: tl.constexpr, HW_CVT: tl.constexpr,
                DOT_F32: tl.constexpr):
    """E4M3 rows ``[R, D]`` (uint8) as bf16 values (float32 with DOT_F32), read as 32-bit
    words: a byte-wide load would be gathered byte by byte from shared memory into the
    MMA's layout. Each word's four bytes are converted apart and put back in order:
    ``join`` adds a trailing axis, so joining (v0, v2) with (v1, v3) flattens to v0, v1,
    v2, v3.

    LIFTED: the values times 2^-120 (``_e4m3_lifted``). On a GPU by PTX on the word:
    ``prmt`` puts bytes 0 and 1 (then 2 and 3) in the high bytes of a register's bf16
    halves, two masks, a shift and an or finish both: ten ALU instructions for four
    values, where the conversion instructions (E4M3 to f16 to bf16) run at a quarter of
    the ALU rate. Otherwise the GPU's conversion (exact), or integer decoding in the interpreter."""
    words = tl.load(v_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows[:, None] * (D // 4)
                    + tl.arange(0, D // 4)[None, :], mask=mask[:, None], other=0)
    if LIFTED and HW_CVT and not DOT_F32:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            """{
            .reg .b32 t, a, s;
            prmt.b32 t, $4, 0, 0x1404;
            and.b32 a, t, 0x7F007F00; shr.b32 a, a, 4; and.b32 s, t, 0x80008000; or.b32 a, a, s;
            mov.b32 {$0, $1}, a;
            prmt.b32 t, $4, 0, 0x3424;
            and.b32 a, t, 0x7F007F00; shr.b32 a, a, 4; and.b32 s, t, 0x80008000; or.b32 a, a, s;
            mov.b32 {$2, $3}, a;
            }""",
            "=h,=h,=h,=h,r", [words], dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
            pack=1)
    elif LIFTED:
        v0 = _e4m3_lifted(words & 0xFF, DOT_F32)
        v1 = _e4m3_lifted((words >> 8) & 0xFF, DOT_F32)
        v2 = _e4m3_lifted((words >> 16) & 0xFF, DOT_F32)
        v3 = _e4m3_lifted((words >> 24) & 0xFF, DOT_F32)
    else:
        v0 = _fp8((words & 0xFF).to(tl.uint8), 4, HW_CVT, DOT_F32)
        v1 = _fp8(((words >> 8) & 0xFF).to(tl.uint8), 4, HW_CVT, DOT_F32)
        v2 = _fp8(((words >> 16) & 0xFF).to(tl.uint8), 4, HW_CVT, DOT_F32)
        v3 = _fp8(((words >> 24) & 0xFF).to(tl.uint8), 4, HW_CVT, DOT_F32)
    return tl.join(tl.join(v0, v2), tl.join(v1, v3)).reshape(v0.shape[0], D)


@triton.jit
def _block_scales(scales_ptr, rows, mask, NB: tl.constexpr, NV: tl.constexpr, HW_CVT: tl.constexpr):
    """float32 block scales ``[R, NB]`` at ``rows``: unsigned E4M3 (NVFP4, 0x7F for a
    non-finite block: E4M3's NaN, so the GPU's conversion gives NaN too) or E8M0
    (``2^(s - 127)``, 0xFF = NaN). E8M0's s = 0 (2^-127, a float32 subnormal) reads as
    2^-126: only blocks of magnitude ~1e-38 differ, whose scores are ~0 either way."""
    cols = tl.arange(0, NB)
    sc = tl.load(scales_ptr + rows[:, None] * NB + cols[None, :], mask=mask[:, None], other=0)
    if NV and HW_CVT:
        return sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif NV:
        return tl.where(sc == 0x7F, float("nan"), e4m3_value(sc.to(tl.int32)))
    else:
        sc = sc.to(tl.int32)
        return tl.where(sc == 0xFF, float("nan"), pow2(tl.maximum(sc - 127, -126)))


@triton.jit
def _scaled(values, scales, R: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, DOT_F32: tl.constexpr):
    """values ``[R, W]`` times the scale of their block (``NB`` blocks of ``W // NB``):
    a product of at most 6 significant bits, exact in bf16."""
    blocked = tl.reshape(values, (R, NB, W // NB)) * _as_operand(scales, DOT_F32)[:, :, None]
    return tl.reshape(blocked, (R, W))


@triton.jit
def _low_keys(codes_ptr, scales_ptr, rows, mask, D: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
              NV: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    """4-bit rows as two operands ``[R, D/2]``: the even elements (low nibbles) and the
    odd ones (high nibbles), each times its block scale. Q is split the same way, so
    Q·Kᵀ is the sum of the two halves' products and the nibbles are never interleaved.

    NVFP4 rows come out times 2^-63 (their caller lifts Q's by 2^126): the nibbles are
    decoded lifted (``_e2m1``, value · 2^-126) and multiplied by ``sb · 2^63``. An E4M3
    scale lies in [2^-9, 448], so ``sb · 2^63`` and the product ``e · sb · 2^-63`` are
    normal bf16 values, exact (at most 6 significant bits). MXFP4's E8M0 scales span
    2^-127..2^127, too wide to lift, so its nibbles are decoded to their values."""
    cols = tl.arange(0, D // 2)
    packed = tl.load(codes_ptr + rows[:, None] * (D // 2) + cols[None, :], mask=mask[:, None], other=0)
    scales = _block_scales(scales_ptr, rows, mask, D // BLOCK, NV, HW_CVT)
    if NV:
        scales = scales * 9223372036854775808.0  # 2^63
    even, odd = _nibbles(packed, NV, HW_CVT, DOT_F32)
    even = _scaled(even, scales, R, D // 2, D // BLOCK, DOT_F32)
    odd = _scaled(odd, scales, R, D // 2, D // BLOCK, DOT_F32)
    return even, odd


@triton.jit
def _high_keys(codes_ptr, scales_ptr, rows, mask, D: tl.constexpr, R: tl.constexpr, EXP_BITS: tl.constexpr,
               HW_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    """8-bit MX rows ``[R, D]``, each element times its block scale; or, with bf16's
    EXP_BITS (``DMAConfig(high="bf16")``), the bf16 rows themselves."""
    cols = tl.arange(0, D)
    codes = tl.load(codes_ptr + rows[:, None] * D + cols[None, :], mask=mask[:, None], other=0)
    # (One return after the branch: the compiler, unlike the interpreter, would still
    # build the code after a return inside a compile-time branch.)
    if EXP_BITS == BF16_EXP_BITS:
        keys = _as_operand(codes.to(tl.float32), DOT_F32)
    else:
        scales = _block_scales(scales_ptr, rows, mask, D // 32, False, HW_CVT)
        keys = _scaled(_fp8(codes, EXP_BITS, HW_CVT, DOT_F32), scales, R, D, D // 32, DOT_F32)
    return keys


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ bᵀ in float32."""
    if DOT_F32:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), out_dtype=tl.float32)


@triton.jit
def _decode_run(
    acc, m_i, l_i, query, cache, where, start, stop,
    MODE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, HI_E: tl.constexpr, LO_BLOCK: tl.constexpr,
    LO_NV: tl.constexpr, V_FP8: tl.constexpr, V_LIFT: tl.constexpr, P_DTYPE: tl.constexpr,
    PV_F32: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online base-2 softmax over keys [start, stop) (``start`` a multiple of BLOCK_N,
    which divides TILE) in one MODE: low copies, high copies, or both with the format
    chosen per row (``row_high``). Every block is masked: key < length and, causally,
    key <= the row's position. The cache pointers point at this batch row, so the
    loop indexes in int32. The runs of a program share their tensors, in tuples:
    ``query`` (Q's operands, each row's high flag and position), ``cache`` (the cache's
    pointers) and ``where`` (kv head, kv heads, filled length, the high slots); the
    compile-time switches stay arguments of their own (Triton does not keep a tuple's
    elements constant)."""
    q_hi, q_even, q_odd, q_s2, row_high, q_pos = query
    lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v_ptr, v_scale = cache
    hkv, HKV, length, sink_len, ring_len = where
    offs = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    for n0 in range(start, stop, BLOCK_N):
        t = n0 + offs
        t_ok = t < length
        rows = t * HKV + hkv  # int32: the plan checks S * HKV * D < 2^31
        if MODE != _HIGH:
            k_even, k_odd = _low_keys(lo_codes, lo_scales, rows, t_ok, D, BLOCK_N, LO_BLOCK, LO_NV, HW_CVT,
                                      DOT_F32)
            s_lo = _dot(q_even, k_even, DOT_F32) + _dot(q_odd, k_odd, DOT_F32)
            if LO_NV:
                # NVFP4's per-token scales s2 of the query row and of the key.
                k_s2 = tl.load(lo_token + rows, mask=t_ok, other=1.0)
                s_lo = (s_lo * q_s2[:, None]) * k_s2[None, :]
        if MODE != _LOW:
            # A block lies inside one tile, and a tile's positions have consecutive slots.
            slot0 = tl.where(n0 < sink_len, n0, sink_len + n0 % ring_len)
            hi_rows = (slot0 + offs) * HKV + hkv
            s_hi = _dot(q_hi, _high_keys(hi_codes, hi_scales, hi_rows, t_ok, D, BLOCK_N, HI_E, HW_CVT, DOT_F32),
                        DOT_F32)
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
        # P is rounded to the input dtype before P·V, as in the prefill kernel and the
        # reference; the row sum above uses the unrounded P.
        if P_DTYPE == "bfloat16":
            p = to_bf16(p, HW_CVT)
        elif P_DTYPE == "float16":
            p = p.to(tl.float16)
        if V_FP8:
            # E4M3 values with one E8M0 scale per token: the scale multiplies P's column
            # (exact: a power of two), the values go in as they are. Lifted values
            # (V_LIFT) are value · 2^-120: P's column takes 2^(e - c + 120) instead and
            # the block's product 2^c, c the largest exponent of the block's finite
            # tokens, so every factor is a power of two that stays in bf16's range.
            vs = tl.load(v_scale + rows, mask=t_ok, other=127).to(tl.int32)
            e = tl.maximum(vs - 127, -126)
            if V_LIFT:
                c = tl.max(tl.where(t_ok & (vs != 0xFF), e, -126), axis=0)
                e = tl.minimum(tl.maximum(e - c + 120, -126), 120)  # masked tokens: any finite factor
            factor = tl.where(vs == 0xFF, float("nan"), pow2(e))
            p = p.to(tl.float32) * factor[None, :]
            if not PV_F32:
                p = p.to(tl.bfloat16)
            v = _e4m3_words(v_ptr, rows, t_ok, D, V_LIFT, HW_CVT, PV_F32)
        else:
            v = tl.load(v_ptr + rows[:, None] * D + cols[None, :], mask=t_ok[:, None], other=0.0)
        if PV_F32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v.to(p.dtype), out_dtype=tl.float32)
        if V_LIFT:
            pv = pv * pow2(c)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _dma_decode_kernel(
    q_hi_codes, q_hi_scales, q_lo_codes, q_lo_scales, q_lo_token,
    lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v_ptr, v_scale, lengths,
    n_q, S, R, HQ, HKV, sink_len, ring_len, diag, sink, split_len,
    o_acc, o_m, o_l,
    D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HI_E: tl.constexpr, LO_BLOCK: tl.constexpr, LO_NV: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, MIXED: tl.constexpr, V_FP8: tl.constexpr, V_LIFT: tl.constexpr,
    P_DTYPE: tl.constexpr, PV_F32: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr,
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
    if DOT_F32:
        placeholder = tl.zeros((BLOCK_M, D // 2), tl.float32)
    else:
        placeholder = tl.zeros((BLOCK_M, D // 2), tl.bfloat16)
    q_hi = tl.join(placeholder, placeholder).reshape(BLOCK_M, D)
    q_even, q_odd, q_s2 = placeholder, placeholder, tl.full((BLOCK_M,), 1.0, tl.float32)
    if HAS_HI:
        q_hi = _high_keys(q_hi_codes, q_hi_scales, q_rows, m_ok, D, BLOCK_M, HI_E, HW_CVT, DOT_F32)
    if HAS_LO:
        q_even, q_odd = _low_keys(q_lo_codes, q_lo_scales, q_rows, m_ok, D, BLOCK_M, LO_BLOCK, LO_NV, HW_CVT,
                                  DOT_F32)
        if LO_NV:
            # NVFP4 operands come times 2^-63 (_low_keys): Q's times 2^126 make the
            # products those of the values, exact (Q's at most 2688 · 2^63).
            lift = 85070591730234615865843651857942052864.0  # 2^126
            q_even, q_odd = (q_even * lift).to(q_even.dtype), (q_odd * lift).to(q_odd.dtype)
            q_s2 = tl.load(q_lo_token + q_rows, mask=m_ok, other=1.0)

    # Key tile t is high for row r when t < sink or (row tile) - t < diag: the band
    # starts at tile (row tile) - diag + 1, one tile later for rows past a tile edge.
    first_tile = (length - n_q) // _TILE
    last_tile = (length - 1) // _TILE
    sink_end = tl.minimum(sink * _TILE, length)
    both_start = tl.maximum(tl.minimum((first_tile - diag + 1) * _TILE, length), sink_end)
    band_start = tl.maximum(tl.minimum((last_tile - diag + 1) * _TILE, length), both_start)
    # In the mixed tile (both_start .. band_start, at most one), the rows that are high.
    row_high = ((q_pos // _TILE) - both_start // _TILE) < diag

    # The cache arrays of batch row b: 64-bit offsets once, int32 indices in the loop.
    row0 = b.to(tl.int64) * S * HKV
    slot_row0 = b.to(tl.int64) * R * HKV
    lo_codes += row0 * (D // 2)
    lo_scales += row0 * (D // LO_BLOCK)
    lo_token += row0  # placeholders (MXFP4's token scales, bf16 V's scales) are never read
    v_scale += row0
    v_ptr += row0 * D
    hi_codes += slot_row0 * D
    hi_scales += slot_row0 * (D // 32)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, length)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    # The runs in key order: sink (high), far (low), the mixed tile, the band (high).
    # Without high pairs everything is far; without low pairs everything is high. A
    # mixed tile needs rows on both sides of a tile edge: never with one row (MIXED).
    query = (q_hi, q_even, q_odd, q_s2, row_high, q_pos)
    cache = (lo_codes, lo_scales, lo_token, hi_codes, hi_scales, v_ptr, v_scale)
    where = (hkv, HKV, length, sink_len, ring_len)
    if HAS_HI and HAS_LO:
        acc, m_i, l_i = _decode_run(
            acc, m_i, l_i, query, cache, where, lo, tl.minimum(sink_end, hi),
            _HIGH, D, BLOCK_N, HI_E, LO_BLOCK, LO_NV, V_FP8, V_LIFT, P_DTYPE, PV_F32, HW_CVT, DOT_F32)
        acc, m_i, l_i = _decode_run(
            acc, m_i, l_i, query, cache, where, tl.maximum(sink_end, lo), tl.minimum(both_start, hi),
            _LOW, D, BLOCK_N, HI_E, LO_BLOCK, LO_NV, V_FP8, V_LIFT, P_DTYPE, PV_F32, HW_CVT, DOT_F32)
        if MIXED:
            acc, m_i, l_i = _decode_run(
                acc, m_i, l_i, query, cache, where, tl.maximum(both_start, lo), tl.minimum(band_start, hi),
                _BOTH, D, BLOCK_N, HI_E, LO_BLOCK, LO_NV, V_FP8, V_LIFT, P_DTYPE, PV_F32, HW_CVT, DOT_F32)
        acc, m_i, l_i = _decode_run(
            acc, m_i, l_i, query, cache, where, tl.maximum(band_start, lo), hi,
            _HIGH, D, BLOCK_N, HI_E, LO_BLOCK, LO_NV, V_FP8, V_LIFT, P_DTYPE, PV_F32, HW_CVT, DOT_F32)
    else:
        acc, m_i, l_i = _decode_run(
            acc, m_i, l_i, query, cache, where, lo, hi,
            _HIGH if HAS_HI else _LOW, D, BLOCK_N, HI_E, LO_BLOCK, LO_NV, V_FP8, V_LIFT, P_DTYPE, PV_F32, HW_CVT,
            DOT_F32)
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
