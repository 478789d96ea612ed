"""Fused dual quantization of Q or K into a high (MXFP8) and a low (NVFP4/MXFP4) copy,
and the channel reductions around it.

One program quantizes ``BLOCK_T`` tokens of one (batch, head) at a time: it
reads the bf16/fp16 tile once, optionally subtracts K's per-channel mean
(smooth-K) and multiplies by the folded softmax scale (Q), then writes both
copies with their scale bytes and, for NVFP4, the float32 per-token scale. For
sm_90 it writes E4M3 copies instead; K's share one scale per ``TILE`` keys, so a
K program first reads its whole tile for the scale (the tile's largest element,
``_tile_references``) and then quantizes its share of it. The numerics are those
of ``dma_jax.formats`` bit for bit, with arithmetic chosen to keep the GPU's
integer pipe free (``mx``): E2M1 elements round by float32 tricks
(``round_e2m1``), E4M3 values on a GPU by the conversion instruction, which rounds
to nearest even with saturation as the formats do (``round_e4m3``; Triton's
interpreter, whose conversion does not, keeps an exact emulation), and NVFP4's
divisions by a reciprocal with Markstein's correction (``div_by``), equal to
``div_rn`` wherever the quotient is a normal float; the fold and the subnormal
flush after it are one FTZ instruction on a GPU (``mul_flushed``).

Smooth-K needs the mean over all valid tokens with finite elements before any tile
can be quantized, so a reduction launch first writes per-chunk partial sums and
token counts (``_channel_reduce_kernel``), and each K program adds them up itself
(``_channel_total``, in a fixed order); K is read twice.

Launched through ``plan``; this module holds kernel code only.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from .format_table import NVFP4_TOKEN_DIVISOR
from .geometry import TILE
from .mx import (BF16_EXP_BITS, E4M3_EMIN, E4M3_EXP_BITS, E4M3_MAN_BITS, abs_max, div_by, e4m3_bytes,
                 e4m3_bytes_on_grid_or_small, e4m3_scale, element_code, exponent, flush_subnormals, mul_flushed,
                 mx_exponent, nan_max, pairwise_sum, pow2, round_e2m1, round_e4m3, round_to_e4m3_emulated,
                 round_to_element, to_bf16)
from .rotation import hadamard_rows

# _nvfp4_s2: the divisor, fl(1/divisor), and the smallest token amax whose s2 is a
# normal float.
_NVFP4_DIVISOR = tl.constexpr(NVFP4_TOKEN_DIVISOR)
_RCP_NVFP4_DIVISOR = tl.constexpr(float(np.float32(1.0) / np.float32(NVFP4_TOKEN_DIVISOR)))
_S2_NORMAL_FROM = tl.constexpr(NVFP4_TOKEN_DIVISOR * 2.0**-126)
# Partials that _channel_total requests at once: one load per step made the total a
# chain of L2 round trips.
_SUM_STEP = tl.constexpr(8)
# K's FP8 scale tile, readable inside @triton.jit functions.
_SCALE_TILE = tl.constexpr(TILE)


@triton.jit
def _nvfp4_s2(amax):
    """``flush_subnormals(div_rn(amax, 2688))`` for a token amax (>= 0, Inf or NaN): the
    NVFP4 token scale, before a zero token's 1. The quotient is a normal float exactly
    from amax = 2688 · 2^-126 on (2^-126 there; just below, the tie with the largest
    subnormal rounds up to it, to even, and no float amax lies in between), where
    ``div_by`` with the rounded reciprocal of 2688 gives it correctly rounded in three
    instructions instead of a full division; below, the division's result is flushed to
    0. Inf and NaN keep the division's results (Inf, NaN)."""
    q = div_by(amax, _NVFP4_DIVISOR, _RCP_NVFP4_DIVISOR)
    return tl.where(amax >= _S2_NORMAL_FROM, tl.where(amax < float("inf"), q, amax), tl.where(amax == amax, 0.0, amax))


@triton.jit
def _token_reference(amax, EMAX: tl.constexpr, MAN_BITS: tl.constexpr, MAX_VALUE: tl.constexpr,
                     RULE: tl.constexpr, NVFP4: tl.constexpr):
    """Per token, from its amax (``abs_max`` over head_dim): the scale that
    ``_fp8_copy`` would give the token alone (MX: ``2^T``; NVFP4: the raw ``s2``, 0
    for an all-zero token), or the smallest candidate (MX ``2^-126``, NVFP4 0) for a
    token with NaN or Inf. The amax is all it needs: every scale rule is monotone in
    a block's amax, so the largest block exponent is that of the token's largest
    element."""
    finite = amax < float("inf")  # False for Inf and NaN
    if NVFP4:
        ref = _nvfp4_s2(tl.where(finite, amax, 0.0))
    else:
        top = mx_exponent(tl.where(finite, amax, 0.0), EMAX, MAN_BITS, MAX_VALUE, RULE)
        ref = pow2(tl.maximum(top + EMAX - 8, -126))
    return ref


@triton.jit
def _fp8_copy(r, v, block_exp, sb, s2, finite, tile_ref, EMAX: tl.constexpr, NVFP4: tl.constexpr,
              PER_TILE: tl.constexpr, HW_CVT: tl.constexpr, E4M3_ELEMENTS: tl.constexpr,
              ZERO_SIGNS: tl.constexpr, ZERO_BYTES: tl.constexpr):
    """The E4M3 copy of one quantized [T, NB, BLOCK] tile (its bytes), its scale
    (float32 per token; unused when PER_TILE) and which tokens are finite, as
    ``dma_jax.formats.fp8_per_token`` / ``fp8_per_tile`` define them.

    MX blocks shift their power-of-two block exponent into the elements, relative to
    ``2^T`` (per token ``T = max_b X_b + EMAX - 8``, per tile the tile's largest):
    exact unless an element drops into E4M3's subnormals. NVFP4 rounds
    ``e · sb / 8`` (per tile times ``s2 / s2_max``) to E4M3, within 2^-4.
    ``tile_ref``: the tile's ``2^T`` (MX) or ``s2_max`` (NVFP4) when PER_TILE. ``r``
    holds the rounded elements, ``v`` the values they were rounded from.
    ZERO_SIGNS (NVFP4): ``r`` of a non-finite block is finite and unsigned (see
    ``_quantize_tile``), so that ``r · sb`` with its ``sb = 0`` is the copy's +0 with no
    select per element. ZERO_BYTES (E4M3 elements on a GPU, per token): ``v`` of a
    non-finite block is not zeroed, its bytes are.
    HW_CVT: E4M3 rounding by the GPU's conversion instruction, which also gives the
    bytes (``mx.e4m3_bytes``).

    PER_TILE shares the scale, so a non-finite token's row must be E4M3 NaN (0x7F),
    making only that key's scores NaN. With HW_CVT a NaN factor gives those bytes
    (the conversion turns NaN into 0x7F; a select of bytes would compile to bit-mask
    arithmetic per element); the interpreter's emulation does not, and the caller
    selects the bytes (``NAN_ROWS_BY_CVT``).
    """
    token_ok = tl.min(finite.to(tl.int32), axis=1) > 0
    NAN_ROWS_BY_CVT: tl.constexpr = PER_TILE and HW_CVT
    if NVFP4:
        values = r * (sb * 0.125)[:, :, None]
        if PER_TILE:
            ratio = tl.math.div_rn(s2, tl.full(s2.shape, 1.0, tl.float32) * tile_ref)
            if NAN_ROWS_BY_CVT:
                ratio = tl.where(token_ok, ratio, float("nan"))
            values = values * ratio[:, None, None]
        if not (NAN_ROWS_BY_CVT or ZERO_SIGNS):
            # A non-finite block has sb = 0 but elements of either sign: its copy is +0.
            # (Selected as floats: a select of bytes compiles to bit-mask arithmetic.)
            # With NaN rows every block left is finite.
            values = tl.where(finite[:, :, None], values, 0.0)
        codes = e4m3_bytes(values, HW_CVT)
        token = s2 * 8.0
    else:
        if PER_TILE:
            t = exponent(tile_ref)
            shift = tl.maximum(block_exp - t, -126)
        else:
            t = tl.maximum(tl.max(tl.where(finite, block_exp, -127), axis=1) + EMAX - 8, -126)
            shift = tl.maximum(block_exp - t[:, None], -126)
        factor = pow2(shift)
        if NAN_ROWS_BY_CVT:
            factor = tl.where(token_ok[:, None], factor, float("nan"))
        # r has at most 4 significant bits and |r * 2^shift| <= 448, so the product is
        # an E4M3 value unless it falls below E4M3's normal range. (A non-finite
        # block's r is +0 already.)
        if HW_CVT and E4M3_ELEMENTS:
            # E4M3 elements (shift <= 0) rescale on packed float16 pairs: the product is
            # exact in float16 down to 2^-24, and where float16 rounds (below 2^-20) or
            # 2^shift underflows to 0, E4M3 rounds to a signed zero either way.
            y = v.to(tl.float8e4nv).to(tl.float16) * factor.to(tl.float16)[:, :, None]
            codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            if ZERO_BYTES:
                # A non-finite block's copy is +0. Its bytes (NaN or ±448 from the
                # unmasked v) are cleared after the conversion, four per `and`: a select
                # of the float values cost one instruction per element, a Triton `&` of
                # bytes too.
                keep = tl.broadcast_to(tl.where(finite, 0xFF, 0).to(tl.uint8)[:, :, None], codes.shape)
                codes = tl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [codes, keep],
                                                  dtype=tl.uint8, is_pure=True, pack=4)
        else:
            codes = e4m3_bytes_on_grid_or_small(r * factor[:, :, None], HW_CVT)
        token = pow2(t)
    return codes, tl.where(token_ok, token, float("nan")), token_ok


@triton.jit
def _block_quotients(xs, sb, finite, ZERO_UNUSABLE: tl.constexpr):
    """``div_rn(xs, sb)`` per [T, NB, BLOCK] block (by a reciprocal and ``div_by``) for
    the blocks with a usable scale (finite, nonzero); the others divide by 1 and, with
    ZERO_UNUSABLE, are zeros. The NVFP4 elements before rounding, for either 4/6
    candidate."""
    usable = finite & (sb > 0)
    sb_b = tl.where(usable, sb, 1.0)[:, :, None]
    v = div_by(xs, sb_b, tl.math.div_rn(tl.full(sb_b.shape, 1.0, tl.float32), sb_b))
    if ZERO_UNUSABLE:
        v = tl.where(usable[:, :, None], v, 0.0)
    return v


@triton.jit
def _quantize_tile(
    x, rows, cols, mask, tile_ref,
    codes_ptr, scales_ptr, token_ptr, f8_ptr, ts_ptr,
    EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    MAX_VALUE: tl.constexpr, BLOCK: tl.constexpr, NVFP4: tl.constexpr, RULE: tl.constexpr,
    BLOCK_T: tl.constexpr, D: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_FP8: tl.constexpr,
    PER_TILE: tl.constexpr, HW_CVT: tl.constexpr, BF16_COPY: tl.constexpr,
):
    """Quantize a [BLOCK_T, D] float32 tile into one format, its block scales chosen
    by RULE (``format_table.SCALE_RULES``), and store it.

    rows: token indices into the flattened [tokens] outputs; cols: arange(D).
    WRITE_CODES stores the codes and scale bytes (what ``tl.dot_scaled`` reads on
    sm_100); WRITE_FP8 stores the E4M3 copy (what the FP8 tensor cores of sm_90
    read) and, unless PER_TILE (the caller stores the tile's scale), its token scales.
    BF16_COPY (NVFP4, with WRITE_FP8, never PER_TILE) stores instead the bf16 values
    ``e · sb``, exact in bf16 (at most 6 significant bits), and ``s2`` per token (NaN
    for a token with a non-finite block): Hopper's exact operands for NVFP4 tiles.
    """
    NB: tl.constexpr = D // BLOCK
    E4M3: tl.constexpr = MAN_BITS == E4M3_MAN_BITS.value and EMIN == E4M3_EMIN.value  # MXFP8's default elements
    # The NVFP4 FP8 copy alone zeroes its non-finite blocks through the signs (where
    # the GPU's conversion does not already make their rows NaN: _fp8_copy).
    ZERO_SIGNS: tl.constexpr = NVFP4 and not WRITE_CODES and not (PER_TILE and HW_CVT)
    # The MXFP8 FP8 copy alone, on a GPU, needs no zeroed values either (_fp8_copy):
    # Q's clears those blocks in its bytes, K's (per tile) makes their tokens' whole
    # rows NaN by a NaN factor, whatever the values.
    RAW_V: tl.constexpr = E4M3 and HW_CVT and not WRITE_CODES
    ZERO_BYTES: tl.constexpr = RAW_V and not PER_TILE
    xb = tl.reshape(x, (BLOCK_T, NB, BLOCK))
    amax = abs_max(xb, 2)  # [T, NB]
    if NVFP4:
        # NVFP4 per-token scale: the token amax maps onto 6 (E2M1 max) x 448 (E4M3 max).
        # (The token's amax is the largest of its block amaxes.)
        # A subnormal s2 counts as an all-zero token (as in dma_jax.formats).
        s2 = _nvfp4_s2(nan_max(amax, 1))
        s2 = tl.where(s2 == 0, 1.0, s2)
        # A subnormal quotient counts as zero, as in dma_jax.formats (GPUs keep subnormals).
        sb_f = flush_subnormals(tl.math.div_rn(amax, MAX_VALUE * s2[:, None]))
        finite = (sb_f == sb_f) & (tl.abs(sb_f) < float("inf"))
        sb = e4m3_scale(tl.where(finite, sb_f, 0.0), RULE)
        # x / s2 / sb, each division correctly rounded (the reference's two steps)
        # where the quotient is normal; the reciprocals are taken once per token and
        # per block. Usable blocks are finite with s2 and sb normal, so v is finite
        # (|v| <= 2688 * 2^9). A zero-scale block gives |v| < 1/4: zeros.
        s2_b = s2[:, None, None]
        xs = div_by(xb, s2_b, tl.math.div_rn(tl.full(s2_b.shape, 1.0, tl.float32), s2_b))
        # A non-finite block's codes are signed zeros, +0 for NaN (its sign means
        # nothing). The FP8 copy zeroes such blocks by itself.
        v = _block_quotients(xs, sb, finite, WRITE_CODES)
        # Elements take the sign of x (div_by may lose a zero's).
        sign = xb
        if WRITE_CODES:
            sign = tl.where(xb == xb, xb, 0.0)
        if ZERO_SIGNS:
            # A non-finite block's elements take no sign, so that its copy, r · sb with
            # sb = 0, is +0 (round_e2m1 clamps a NaN or Inf v to 6). One mask per block
            # folds into round_e2m1's sign LOP3, where a select of the copy's values
            # cost an instruction per element.
            keep = tl.where(finite, 0x80000000, 0).to(tl.uint32)
            sign = (xb.to(tl.uint32, bitcast=True) & keep[:, :, None]).to(tl.float32, bitcast=True)
        r = round_e2m1(v, sign)
        if RULE == "4/6":
            # The block maximum mapped to 4 instead of 6 where that reconstructs the
            # block better (sum of the exact errors |xs - r·sb| over a fixed pair tree).
            sb4 = round_to_e4m3_emulated(tl.where(finite, tl.math.div_rn(amax, 4.0 * s2[:, None]), 0.0))
            r4 = round_e2m1(_block_quotients(xs, sb4, finite, WRITE_CODES), sign)
            err6 = pairwise_sum(tl.abs(xs - r * sb[:, :, None]), BLOCK)
            err4 = pairwise_sum(tl.abs(xs - r4 * sb4[:, :, None]), BLOCK)
            four = err4 < err6
            sb = tl.where(four, sb4, sb)
            r = tl.where(four[:, :, None], r4, r)
        scale_code = tl.where(finite, element_code(sb, E4M3_EXP_BITS.value, E4M3_MAN_BITS.value, E4M3_EMIN.value), 0x7F)
        block_exp = scale_code  # unused for NVFP4
        if WRITE_CODES:
            tl.store(token_ptr + rows, s2, mask=mask)
    else:
        finite = (amax == amax) & (amax < float("inf"))
        block_exp = mx_exponent(tl.where(finite, amax, 0.0), EMAX, MAN_BITS, MAX_VALUE, RULE)
        # Multiply by 2^-e: -e lies in [-125, 127], so the factor is a normal float.
        v = xb * pow2(-block_exp)[:, :, None]
        if not RAW_V:
            v = tl.where(finite[:, :, None], v, 0.0)
        scale_code = tl.where(finite, block_exp + 127, 255)
        sb = amax  # unused for MX
        s2 = amax
        if E4M3:
            r = round_e4m3(v, HW_CVT)
        elif MAN_BITS == 1 and EMIN == 0:  # E2M1 elements (MXFP4)
            r = round_e2m1(v, v)
        else:
            r = round_to_element(v, MAN_BITS, EMIN, MAX_VALUE)
    if WRITE_FP8 and BF16_COPY:
        # A non-finite block has sb = 0 and finite elements: its values are zeros, and
        # its token's NaN scale makes the key's scores NaN.
        values = tl.reshape(r * tl.where(finite, sb, 0.0)[:, :, None], (BLOCK_T, D))
        token_ok = tl.min(finite.to(tl.int32), axis=1) > 0
        tl.store(ts_ptr + rows, tl.where(token_ok, s2, float("nan")), mask=mask)
        tl.store(f8_ptr + rows[:, None] * D + cols[None, :], values.to(tl.bfloat16), mask=mask[:, None])
    elif WRITE_FP8:
        f8, token, token_ok = _fp8_copy(r, v, block_exp, sb, s2, finite, tile_ref, EMAX, NVFP4, PER_TILE, HW_CVT,
                                        E4M3, ZERO_SIGNS, ZERO_BYTES)
        f8 = tl.reshape(f8, (BLOCK_T, D))
        if PER_TILE:
            if not HW_CVT:  # a non-finite token's row is E4M3 NaN (see _fp8_copy)
                f8 = tl.where(token_ok[:, None], f8, 0x7F)
        else:
            tl.store(ts_ptr + rows, token, mask=mask)
        tl.store(f8_ptr + rows[:, None] * D + cols[None, :], f8.to(tl.uint8), mask=mask[:, None])
    if WRITE_CODES:
        codes = tl.reshape(element_code(r, EXP_BITS, MAN_BITS, EMIN), (BLOCK_T, D))
        sblk = tl.arange(0, NB)
        tl.store(scales_ptr + rows[:, None] * NB + sblk[None, :], scale_code.to(tl.uint8), mask=mask[:, None])
        if EXP_BITS + MAN_BITS == 3:
            # Two E2M1 codes per byte along head_dim, element 2t in the low nibble.
            lo, hi = tl.split(tl.reshape(codes, (BLOCK_T, D // 2, 2)))
            packed = (lo | (hi << 4)).to(tl.uint8)
            half = tl.arange(0, D // 2)
            tl.store(codes_ptr + rows[:, None] * (D // 2) + half[None, :], packed, mask=mask[:, None])
        else:
            tl.store(codes_ptr + rows[:, None] * D + cols[None, :], codes.to(tl.uint8), mask=mask[:, None])


@triton.jit
def _tokens(x_ptr, L, H, t, b, h, D: tl.constexpr, end):
    """Tokens ``t`` of x[b, :, h] (x [B, L, H, D], contiguous) as float32 [T, D], zeros
    from token ``end`` on."""
    ptrs = x_ptr + ((b * L + t) * H + h)[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(ptrs, mask=(t < end)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _channel_total(part_ptr, count_ptr, n_parts, count, B, H, b, h, D: tl.constexpr, COUNTED: tl.constexpr):
    """(sum of the partials of (b, h), in chunk order) / the token count, float32 [D];
    partials ``[n_parts, B, H, D]`` and, with COUNTED, their token counts
    ``[n_parts, B, H]`` (``_channel_reduce_kernel``'s; else the scalar ``count``). A
    count of zero (no finite token) divides by one: a zero mean. One sequential order
    for every kernel that forms K's mean, so the mean has the same bits wherever it is
    formed. ``_SUM_STEP`` partials are requested at once: one load per step made
    the total a chain of L2 round trips (~6 µs for 32 partials on an H100)."""
    cols = tl.arange(0, D)
    acc = tl.zeros((D,), tl.float32)
    n = tl.zeros((), tl.float32)
    for c0 in range(0, n_parts, _SUM_STEP):
        for i in tl.static_range(_SUM_STEP):
            c = c0 + i
            # The padding adds +0.0, which changes no bit: acc starts at +0.0 and a
            # round-to-nearest sum is -0.0 only when both addends are.
            acc += tl.load(part_ptr + ((c * B + b) * H + h) * D + cols, mask=c * D + cols < n_parts * D, other=0.0)
            if COUNTED:
                n += tl.load(count_ptr + (c * B + b) * H + h, mask=c < n_parts, other=0.0)
    if not COUNTED:
        n = tl.zeros((), tl.float32) + count
    return tl.math.div_rn(acc, tl.full((D,), 1.0, tl.float32) * tl.maximum(n, 1.0))


@triton.jit
def _channel_row(part_ptr, count_ptr, n_parts, count, H, b, h, D: tl.constexpr, SMOOTH: tl.constexpr,
                 COUNTED: tl.constexpr):
    """K's channel mean of (b, h) as a [1, D] row (smooth-K), else 0; arguments as for
    ``_channel_total`` (grid (tokens, H, B)). Formed once per program: loaded in the
    token loop it was moved into the tiles' layout through shared memory (two
    barriers) at every step."""
    if SMOOTH:
        return _channel_total(part_ptr, count_ptr, n_parts, count, tl.num_programs(2), H, b, h, D, COUNTED)[None, :]
    else:
        return 0.0


@triton.jit
def _shifted(x_ptr, mean, L, H, t, b, h, D: tl.constexpr, SMOOTH: tl.constexpr, PAST_L: tl.constexpr):
    """Tokens ``t`` of x[b, :, h] as float32 [T, D], minus K's channel mean ``mean``
    (smooth-K; ``_channel_row``). Tokens past L are zeros with PAST_L, which a tile's
    largest scale needs (they must not count in it); elsewhere their rows are never
    stored and hold whatever the subtraction gives, a select per element saved."""
    x = _tokens(x_ptr, L, H, t, b, h, D, L)
    if SMOOTH:
        x = x - mean
        if PAST_L:
            x = tl.where((t < L)[:, None], x, 0.0)
    return x


@triton.jit
def _rotated(x_ptr, mean, L, H, t, b, h, D: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr,
             PAST_L: tl.constexpr):
    """``_shifted``, times the Walsh–Hadamard matrix with ROTATE (after smoothing, in
    registers: the rotation costs no pass over memory). Rows of zeros stay zeros."""
    x = _shifted(x_ptr, mean, L, H, t, b, h, D, SMOOTH, PAST_L)
    if ROTATE:
        x = hadamard_rows(x, t.shape[0], D)
    return x


@triton.jit
def _prepared(x_ptr, mean, fold, L, H, t, b, h, D: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr,
              HW: tl.constexpr, FTZ_FOLD: tl.constexpr, PAST_L: tl.constexpr):
    """``_rotated`` times ``fold`` (Q's softmax scale), subnormals flushed: what is quantized."""
    return mul_flushed(_rotated(x_ptr, mean, L, H, t, b, h, D, SMOOTH, ROTATE, PAST_L), fold, HW, FTZ_FOLD)


@triton.jit
def _tile_references(x_ptr, mean, fold, L, H, tile, b, h, D: tl.constexpr, BLOCK_T: tl.constexpr,
                     SMOOTH: tl.constexpr, ROTATE: tl.constexpr,
                     HI_EMAX: tl.constexpr, HI_M: tl.constexpr, HI_MAX: tl.constexpr, HI_RULE: tl.constexpr,
                     LO_EMAX: tl.constexpr, LO_M: tl.constexpr, LO_MAX: tl.constexpr, LO_RULE: tl.constexpr,
                     LO_NVFP4: tl.constexpr, HW_CVT: tl.constexpr, FTZ_FOLD: tl.constexpr):
    """K's FP8 scale references for one ``TILE``-token tile: the largest
    ``_token_reference`` of its tokens per copy (MX at least 2^-126; NVFP4 0 while no
    token is non-zero).

    The references are monotone in a token's amax, and so is what ``_prepared`` does
    to the largest |element| of ``_rotated`` (multiplying by
    ``fold``: ``|fl(y·f)| = fl(|y|·|f|)``, flushing subnormals). So one max per element
    over the tile, with no per-token work, gives both references at once. That is
    exact while every element is finite; the maxima propagate Inf and NaN, and only
    such a tile, whose non-finite tokens must not count, takes a second pass over its
    tokens' amaxes."""
    widest = tl.zeros((BLOCK_T, D), tl.float32)
    for c in range(0, _SCALE_TILE, BLOCK_T):
        t = tile * _SCALE_TILE + c + tl.arange(0, BLOCK_T)
        widest = tl.maximum(widest, tl.abs(_rotated(x_ptr, mean, L, H, t, b, h, D, SMOOTH, ROTATE, True)),
                            propagate_nan=tl.PropagateNan.ALL)
    amax = flush_subnormals(nan_max(nan_max(widest, 1), 0) * tl.abs(fold))
    hi_ref = _token_reference(amax, HI_EMAX, HI_M, HI_MAX, HI_RULE, False)
    lo_ref = _token_reference(amax, LO_EMAX, LO_M, LO_MAX, LO_RULE, LO_NVFP4)
    if not amax < float("inf"):
        hi_ref = tl.full((), 0.0, tl.float32)
        lo_ref = tl.full((), 0.0, tl.float32)
        for c in range(0, _SCALE_TILE, BLOCK_T):
            t = tile * _SCALE_TILE + c + tl.arange(0, BLOCK_T)
            token_amax = abs_max(_prepared(x_ptr, mean, fold, L, H, t, b, h, D, SMOOTH, ROTATE, HW_CVT, FTZ_FOLD,
                                           True), 1)
            hi_ref = tl.maximum(hi_ref, tl.max(_token_reference(token_amax, HI_EMAX, HI_M, HI_MAX, HI_RULE, False)))
            lo_ref = tl.maximum(lo_ref, tl.max(_token_reference(token_amax, LO_EMAX, LO_M, LO_MAX, LO_RULE,
                                                                LO_NVFP4)))
    return hi_ref, lo_ref


@triton.jit
def _dual_quantize_kernel(
    x_ptr, mean_parts, mean_counts, n_parts, mean_count, fold, L, H,
    hi_codes, hi_scales, lo_codes, lo_scales, lo_token, hi_f8, hi_ts, lo_f8, lo_ts,
    D: tl.constexpr, BLOCK_T: tl.constexpr, SMOOTH: tl.constexpr, COUNTED: tl.constexpr, ROTATE: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_FP8: tl.constexpr, WRITE_LO: tl.constexpr,
    HI_E: tl.constexpr, HI_M: tl.constexpr, HI_EMIN: tl.constexpr, HI_EMAX: tl.constexpr,
    HI_MAX: tl.constexpr, HI_BLOCK: tl.constexpr, HI_RULE: tl.constexpr,
    LO_E: tl.constexpr, LO_M: tl.constexpr, LO_EMIN: tl.constexpr, LO_EMAX: tl.constexpr,
    LO_MAX: tl.constexpr, LO_BLOCK: tl.constexpr, LO_NVFP4: tl.constexpr, LO_RULE: tl.constexpr,
    TILE_T: tl.constexpr, PER_TILE: tl.constexpr, HW_CVT: tl.constexpr, FTZ_FOLD: tl.constexpr,
    LO_BF16: tl.constexpr,
):
    """One program per (TILE_T tokens, head, batch) of x [B, L, H, D] (contiguous),
    quantized BLOCK_T tokens at a time: ``(x - mean)``, rotated with ROTATE, times
    ``fold``, into the high and the low format with the block-scale rules HI_RULE and
    LO_RULE. HI_E = 8 (bf16's exponent bits, ``DMAConfig(high="bf16")``, codes only):
    the high copy is the bf16 values themselves.

    PER_TILE (K on sm_90): the FP8 copies get one scale per ``TILE`` tokens (the
    attention tile), written to ``*_ts`` as [B, cdiv(L, TILE), H] by the tile's first
    program. Each program first finds its tile's scale (``_tile_references``, a pass
    over the whole tile), so TILE_T < TILE splits a tile's copies over more programs at
    the price of repeating that pass (``tuning.k_tile_tokens``). WRITE_LO=False skips the low
    copy (every pair is high precision). LO_BF16 (NVFP4 low): the low copy holds bf16
    ``e · sb`` with ``s2`` per token, also for K (``_quantize_tile``'s BF16_COPY)."""
    pid_t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = tl.arange(0, D)
    mean = _channel_row(mean_parts, mean_counts, n_parts, mean_count, H, b, h, D, SMOOTH, COUNTED)
    hi_ref = 1.0
    lo_ref = 1.0
    if PER_TILE:
        tile = pid_t * TILE_T // _SCALE_TILE
        hi_ref, lo_ref = _tile_references(x_ptr, mean, fold, L, H, tile, b, h, D, BLOCK_T, SMOOTH, ROTATE,
                                          HI_EMAX, HI_M, HI_MAX, HI_RULE, LO_EMAX, LO_M, LO_MAX, LO_RULE, LO_NVFP4,
                                          HW_CVT, FTZ_FOLD)
        ts = (b * tl.cdiv(L, _SCALE_TILE) + tile) * H + h
        first = (pid_t * TILE_T) % _SCALE_TILE == 0
        tl.store(hi_ts + ts, hi_ref, mask=first)
        if WRITE_LO and not LO_BF16:
            if LO_NVFP4:
                # A tile of zero (or non-finite) tokens takes s2 = 1, as a zero token does.
                lo_ref = tl.where(lo_ref == 0, 1.0, lo_ref)
                tl.store(lo_ts + ts, lo_ref * 8.0, mask=first)
            else:
                tl.store(lo_ts + ts, lo_ref, mask=first)
    for c in range(0, TILE_T, BLOCK_T):
        t = pid_t * TILE_T + c + tl.arange(0, BLOCK_T)
        mask = t < L
        # Flattened token index in [B, L, H] order: outputs are [B, L, H, ...].
        rows = (b * L + t) * H + h
        x = _prepared(x_ptr, mean, fold, L, H, t, b, h, D, SMOOTH, ROTATE, HW_CVT, FTZ_FOLD, False)
        if HI_E == BF16_EXP_BITS:
            tl.store(hi_codes + rows[:, None] * D + cols[None, :], to_bf16(x, HW_CVT), mask=mask[:, None])
        else:
            _quantize_tile(x, rows, cols, mask, hi_ref, hi_codes, hi_scales, lo_token, hi_f8, hi_ts,
                           HI_E, HI_M, HI_EMIN, HI_EMAX, HI_MAX, HI_BLOCK, False, HI_RULE, BLOCK_T, D, WRITE_CODES,
                           WRITE_FP8, PER_TILE, HW_CVT, False)
        if WRITE_LO:
            _quantize_tile(x, rows, cols, mask, lo_ref, lo_codes, lo_scales, lo_token, lo_f8, lo_ts,
                           LO_E, LO_M, LO_EMIN, LO_EMAX, LO_MAX, LO_BLOCK, LO_NVFP4, LO_RULE, BLOCK_T, D,
                           WRITE_CODES, WRITE_FP8, PER_TILE and not LO_BF16, HW_CVT, LO_BF16)


@triton.jit
def _channel_reduce_kernel(x_ptr, L, H, CHUNK, part_ptr, count_ptr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                           AMAX: tl.constexpr):
    """Partial sums over the tokens with finite elements and their counts (or
    abs-maxima over every token, NaN-propagating) over one CHUNK of tokens of
    x [B, L, H, D], per (head, batch).

    A grid over chunks keeps every SM busy; partials land in [chunks, B, H, D] (counts
    in [chunks, B, H]) and are combined in a fixed order afterwards, so the result is
    deterministic. Each step's BLOCK_T tokens are accumulated element by element and
    reduced over tokens once, at the end: a reduction per step was a cross-warp
    exchange (shared memory, barriers) between dependent loads. The next step's
    tokens are requested before this step's are added, so two loads are in flight.
    Skipping non-finite tokens keeps a NaN or Inf key from spreading through the
    mean to every query row of its head.
    """
    c, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = tl.arange(0, D)
    begin = c * CHUNK
    end = tl.minimum(begin + CHUNK, L)
    acc = tl.zeros((BLOCK_T, D), tl.float32)
    counts = tl.zeros((BLOCK_T,), tl.float32)
    steps = tl.arange(0, BLOCK_T)
    x = _tokens(x_ptr, L, H, begin + steps, b, h, D, end)
    for start in range(begin, end, BLOCK_T):
        following = _tokens(x_ptr, L, H, start + BLOCK_T + steps, b, h, D, end)
        if AMAX:
            acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        else:
            ok = (abs_max(x, 1) < float("inf")) & (start + steps < end)  # False for NaN
            acc += tl.where(ok[:, None], x, 0.0)
            counts += ok.to(tl.float32)
        x = following
    part = nan_max(acc, 0) if AMAX else tl.sum(acc, axis=0)
    row = (c * tl.num_programs(2) + b) * H + h
    tl.store(part_ptr + row * D + cols, part)
    if not AMAX:
        tl.store(count_ptr + row, tl.sum(counts, axis=0))


@triton.jit
def _channel_mean_kernel(part_ptr, count_ptr, H, N_CHUNKS, mean_ptr, D: tl.constexpr):
    """mean = ``_channel_total`` of the partials and counts, per (head, batch)."""
    h, b = tl.program_id(0), tl.program_id(1)
    mean = _channel_total(part_ptr, count_ptr, N_CHUNKS, 0, tl.num_programs(1), H, b, h, D, True)
    tl.store(mean_ptr + (b * H + h) * D + tl.arange(0, D), mean)


@triton.jit
def _fp8_transpose_kernel(x_ptr, part_ptr, L, H, N_CHUNKS, xt_ptr, scale_ptr,
                          D: tl.constexpr, BLOCK_T: tl.constexpr, HW_CVT: tl.constexpr):
    """V for the FP8 P·V: E4M3 with a power-of-two scale per channel, stored
    transposed as [B, H, D, LP] (LP = L rounded up to 16, so that every row starts
    16-byte aligned and loads vectorize; columns past L are zero) as the K-major
    operand of P·V.

    The channel amax comes from ``_channel_reduce_kernel`` partials (AMAX=True);
    numerics as ``dma_jax.formats.fp8_per_channel``. One program per
    (BLOCK_T tokens, head, batch); the first one also writes the scales [B, H, D].
    """
    pid_t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = tl.arange(0, D)
    amax = tl.zeros((D,), tl.float32)
    for c in range(0, N_CHUNKS):
        part = tl.load(part_ptr + ((c * tl.num_programs(2) + b) * H + h) * D + cols)
        amax = tl.maximum(amax, part, propagate_nan=tl.PropagateNan.ALL)
    finite = amax < float("inf")  # False for Inf and NaN
    t_exp = tl.minimum(tl.maximum(exponent(tl.where(finite, amax, 0.0)) - 7, -126), 127)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    x = mul_flushed(_tokens(x_ptr, L, H, t, b, h, D, L), 1.0, HW_CVT, True)
    codes = e4m3_bytes(tl.where(finite[None, :], x * pow2(-t_exp)[None, :], 0.0), HW_CVT)
    codes = tl.trans(codes)  # [D, BLOCK_T]
    # The padding columns [L, LP) get zeros (x was loaded as 0 there). Masking by
    # LP, a multiple of 16, keeps the mask uniform over 16 tokens, so the stores
    # vectorize also where L is not specialised (jax-triton passes it as a plain
    # int; masking by L made the stores byte-wise there).
    LP = tl.cdiv(L, 16) * 16
    tl.store(xt_ptr + ((b * H + h) * D + cols)[:, None] * LP + t[None, :], codes, mask=(t < LP)[None, :])
    scale = tl.where(finite, pow2(t_exp), float("nan"))
    tl.store(scale_ptr + (b * H + h) * D + cols, scale, mask=(cols + pid_t * D) < D)  # first program only
