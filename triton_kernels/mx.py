"""MX / NVFP4 element arithmetic shared by the Triton kernels (encode and decode).

Everything is integer bit manipulation or exact float32 arithmetic, so the kernels
reproduce ``dma_jax.formats`` bit for bit (docs/design.md, "Formats").
"""

import triton
import triton.language as tl

from .format_table import BF16_EXP_BITS as _BF16_EXP_BITS, E4M3

FLOAT32_NORMAL_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126
# E4M3's element parameters, readable inside @triton.jit functions.
E4M3_EXP_BITS = tl.constexpr(E4M3.exp_bits)
E4M3_MAN_BITS = tl.constexpr(E4M3.man_bits)
E4M3_EMIN = tl.constexpr(E4M3.emin)
E4M3_MAX = tl.constexpr(E4M3.max_value)
# The high format "bf16" (values stored unscaled) by its exponent bits.
BF16_EXP_BITS = tl.constexpr(_BF16_EXP_BITS)

@triton.jit
def pow2(e):
    """Exact float32 2**e for integer e in [-126, 127]."""
    return ((e + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exponent(a):
    """floor(log2(a)) for normal positive float32 a; -127 for zero."""
    return ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127


@triton.jit
def flush_subnormals(x):
    """float32 subnormals become zeros of the same sign (as ``dma_jax.formats``).
    ``x * 0`` is that zero for every value it replaces: one FMA-pipe multiply instead
    of an integer sign mask, on the pipe the quantizer leaves the idler."""
    return tl.where(tl.abs(x) < FLOAT32_NORMAL_MIN, x * 0.0, x)


@triton.jit
def mul_flushed(x, f, HW: tl.constexpr, FTZ_MUL: tl.constexpr):
    """``flush_subnormals(x * f)`` for a scalar f, in one instruction per element on
    a GPU (HW) instead of three (multiply, compare, select-multiply).

    FTZ_MUL (f zero or a normal float with |f| <= 1, ``ftz_multiplier``): one
    ``mul.ftz``. It also flushes a subnormal x before multiplying, which changes
    nothing there: |x · f| <= |x| is subnormal or zero anyway, and flushing x first
    gives the same signed zero. Otherwise the multiply and an ``add.ftz`` of -0
    (a subnormal sum becomes a zero of its sign; -0 keeps every other value, zeros'
    signs included). Triton's interpreter has no inline PTX and keeps the select.
    ``plan.ftz_multiplier`` decides FTZ_MUL on the host."""
    if HW and FTZ_MUL:
        # A cast, not f itself: jax-triton passes a scalar equal to 1 as the integer
        # constant 1, whose bits the instruction would read as a float (1.4e-45).
        return tl.inline_asm_elementwise("mul.ftz.f32 $0, $1, $2;", "=f,f,f", [x, tl.cast(f, tl.float32)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    elif HW:
        return tl.inline_asm_elementwise("add.ftz.f32 $0, $1, 0f80000000;", "=f,f", [x * f], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return flush_subnormals(x * f)


@triton.jit
def div_by(a, b, rb):
    """``div_rn(a, b)`` for b > 0 whose reciprocal ``rb = div_rn(1, b)`` is a normal
    float, in one multiply and two FMAs (Markstein's correction) instead of a full
    division per element. The result is the correctly rounded quotient wherever that
    is a normal float (no mismatch in 1.2e8 random pairs shaped like the quantizer's). Elsewhere it is at most 2^-126 in magnitude, and the sign of a zero
    quotient may be lost: every caller rounds such values to zero and takes the sign
    from the dividend. A non-finite a gives a non-finite result (NaN where a division
    gives Inf), which callers zero like any non-finite value."""
    q = a * rb
    # The negation sits on b (one value per block), not on q: ``-q`` made the
    # compiler multiply a * rb a second time, negated (4 instructions, not 3).
    r = tl.fma(q, -b, a)
    return tl.fma(r, rb, q)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max(x, axis: tl.constexpr):
    """max of x along axis, NaN if any element is NaN (as jnp.max): one
    NaN-propagating ``max`` per element (a plain ``tl.max`` drops NaNs, and
    flagging them separately cost three more integer-pipe instructions)."""
    return tl.reduce(x, axis, _max_nan)


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """max |x| along axis, NaN if any element is NaN (as jnp.max)."""
    return nan_max(tl.abs(x), axis)


@triton.jit
def _round_to_quantum(c, up, down, sign_of):
    """c rounded to the nearest multiple of ``down = 1 / up`` (powers of two), half to
    even, carrying the sign of ``sign_of`` (so -0 and negatives that round to zero stay
    negative). Needs |c * up| < 2^22."""
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, half to even
    r = ((c * up + magic) - magic) * down
    sign = sign_of.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_element(v, MAN_BITS: tl.constexpr, EMIN: tl.constexpr, MAX_VALUE: tl.constexpr):
    """Nearest element value of finite v, ties to even, saturating; keeps -0."""
    c = tl.minimum(tl.maximum(v, -MAX_VALUE), MAX_VALUE)
    e = tl.maximum(exponent(tl.abs(c)), EMIN)
    # c * 2^(MAN_BITS - e) is exact and below 2^(MAN_BITS + 1) in magnitude.
    return _round_to_quantum(c, pow2(MAN_BITS - e), pow2(e - MAN_BITS), v)


@triton.jit
def round_to_e4m3_emulated(v):
    """Nearest E4M3 value of finite v, ties to even, saturating at 448, in exact
    float32 arithmetic (what Triton's interpreter needs; see ``round_e4m3``)."""
    # .value: Triton's interpreter passes a constexpr global on as a constexpr, which
    # arithmetic with a tensor would wrap instead of computing.
    return round_to_element(v, E4M3_MAN_BITS.value, E4M3_EMIN.value, E4M3_MAX.value)


@triton.jit
def round_e4m3(v, HW: tl.constexpr):
    """``round_to_e4m3_emulated(v)`` for finite v. HW (a GPU; sm_89+): the
    conversion instruction (``cvt.rn.satfinite.e4m3x2.f32``: nearest, ties to even,
    E4M3 subnormals included, saturating at 448, signed zeros kept) instead of about a
    dozen integer-pipe instructions, the quantizer's bottleneck. Triton's interpreter
    does not round that conversion to nearest, so it keeps the emulation."""
    if HW:
        return v.to(tl.float8e4nv).to(tl.float32)
    else:
        return round_to_e4m3_emulated(v)


@triton.jit
def round_e2m1(v, sign_of):
    """``round_to_element(v, 1, 0, 6.0)`` for finite v, with the sign of ``sign_of``
    (v's own, or the dividend's where v may have lost the sign of a zero).

    FMA-pipe arithmetic plus one compare and select, where the exponent arithmetic of
    ``round_to_element`` kept the integer pipe busy. Below 1 (E2M1's subnormals) the
    quantum is 1/2: adding and subtracting 1.5 · 2^22 (whose float32 quantum is 1/2)
    rounds there, half to even. From 1 to 6, Veltkamp's splitting
    ``g = a·(2^22 + 1); a_2 = g + (a − g)`` rounds a to two significant bits, which is
    E2M1's rounding (nearest, ties to even). Both checked on every float32 of their
    range against ml_dtypes. ``g`` is an explicit FMA so that ``a − g``
    cannot be contracted with the product."""
    a = tl.minimum(tl.abs(v), 6.0)
    halves = (a + 6291456.0) - 6291456.0
    g = tl.fma(a, 4194305.0, 0.0)  # 2^22 + 1
    r = tl.where(a < 1.0, halves, g + (a - g))
    sign = sign_of.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(r):
    """E4M3 bit pattern (uint8) of r, which must already be an E4M3 value (rounded by
    ``round_to_e4m3_emulated`` or the fixed-quantum rounding below): as
    ``element_code`` with E4M3's parameters, but the conversion has nothing to round, so it is
    exact whatever rounding a backend uses, and on sm_89+ it is one instruction per
    two elements instead of a dozen integer operations per element."""
    return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_bytes(v, HW: tl.constexpr):
    """E4M3 bit pattern (uint8) of ``round_e4m3(v, HW)``: on a GPU the conversion
    instruction rounds and encodes at once (one instruction per two elements)."""
    if HW:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return e4m3_code(round_to_e4m3_emulated(v))


@triton.jit
def e4m3_bytes_on_grid_or_small(y, HW: tl.constexpr):
    """``e4m3_bytes(y, HW)`` for finite y that is either an E4M3 value already or
    below E4M3's normal range (|y| < 2^-6). The emulation rounds both cases on E4M3's
    smallest quantum 2^-9 (an E4M3 value is a multiple of it), so one fixed scale
    replaces the per-element exponent arithmetic."""
    if HW:
        return e4m3_bytes(y, True)
    else:
        return e4m3_code(_round_to_quantum(y, 512.0, 0.001953125, y))


@triton.jit
def round_significand(a, MAN_BITS: tl.constexpr):
    """Non-negative float32 a (at least 1, or zero) rounded to MAN_BITS mantissa bits,
    ties to even, with no exponent bound (``dma_jax.formats.round_significand``)."""
    e = tl.maximum(exponent(a), 0)
    return _round_to_quantum(a, pow2(MAN_BITS - e), pow2(e - MAN_BITS), a)


@triton.jit
def mx_exponent(amax, EMAX: tl.constexpr, MAN_BITS: tl.constexpr, MAX_VALUE: tl.constexpr, RULE: tl.constexpr):
    """The E8M0 scale exponent, in [-127, 127], of blocks with finite amax >= 0 under
    RULE ("up", "floor" or "nearest"; ``format_table.SCALE_RULES``), as
    ``dma_jax.formats.mx_exponent``: OCP's floor(log2 amax) - EMAX, one step up where
    amax / 2^e (rounded to the element's precision for "nearest") exceeds MAX_VALUE."""
    e = tl.minimum(tl.maximum(exponent(amax) - EMAX, -127), 127)
    if RULE != "floor":
        # amax / 2^e, exact: -e lies in [-125, 127].
        top = amax * pow2(-e)
        if RULE == "nearest":
            top = round_significand(top, MAN_BITS)
        e = e + (top > MAX_VALUE).to(tl.int32)
    return e


@triton.jit
def e4m3_value(code):
    """The float32 value of a non-negative E4M3 code (int32 in [0, 0x7E]), decoded in
    integer and exact float32 arithmetic."""
    exp = code >> 3
    man = (code & 7).to(tl.float32)
    return tl.where(exp == 0, man * 0.001953125, (man + 8.0) * pow2(exp - 10))


@triton.jit
def e4m3_scale(sb_f, RULE: tl.constexpr):
    """An E4M3 block scale for finite sb_f >= 0 (``dma_jax.formats.e4m3_scale``):
    nearest, ties to even ("nearest", "4/6"), or the neighbour above ("up") or below
    ("floor") where nearest misses sb_f; positive E4M3 codes are ordered like their
    values, so a neighbour is the code plus or minus one."""
    sb = round_to_e4m3_emulated(sb_f)
    if RULE == "up" or RULE == "floor":
        code = element_code(sb, E4M3_EXP_BITS.value, E4M3_MAN_BITS.value, E4M3_EMIN.value)
        if RULE == "up":
            code = tl.where((sb < sb_f) & (code < 0x7E), code + 1, code)
        else:
            code = tl.where((sb > sb_f) & (code > 0), code - 1, code)
        sb = e4m3_value(code)
    return sb


@triton.jit
def pairwise_sum(x, N: tl.constexpr):
    """Sum over the last axis (N long, a power of two) of a 3-d x as a tree of
    neighbour pairs, (x0 + x1) + (x2 + x3) ...: the order of
    ``dma_jax.formats.pairwise_sum``, so that both round alike."""
    for i in tl.static_range(N.bit_length() - 1):
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], N >> (i + 1), 2)))
        x = a + b
    return tl.reshape(x, (x.shape[0], x.shape[1]))


@triton.jit
def element_code(r, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr, EMIN: tl.constexpr):
    """Bit pattern (int32) of an exactly representable element value r."""
    bits = r.to(tl.uint32, bitcast=True)
    a = tl.abs(r)
    bias: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    normal = ((exponent(a) + bias) << MAN_BITS) | ((bits >> (23 - MAN_BITS)) & ((1 << MAN_BITS) - 1)).to(tl.int32)
    subnormal = (a * pow2(tl.full(a.shape, MAN_BITS - EMIN, tl.int32))).to(tl.int32)
    code = tl.where(a >= pow2(tl.full(a.shape, EMIN, tl.int32)), normal, subnormal)
    return code | ((bits >> 31).to(tl.int32) << (EXP_BITS + MAN_BITS))


@triton.jit
def round_to_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), still as float32.

    Triton's interpreter casts float32 to bf16 by truncation (measured with
    triton 3.9; GPUs round to nearest even), so interpreted kernels round first.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)


@triton.jit
def to_bf16(x, HW_CVT: tl.constexpr):
    """float32 -> bf16, rounded to nearest even: the GPU's conversion, or in the
    interpreter (which truncates) ``round_to_bf16`` first."""
    if not HW_CVT:
        x = round_to_bf16(x)
    return x.to(tl.bfloat16)


@triton.jit
def element_value(code, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr):
    """The float32 value of an element code (int32, sign bit at EXP_BITS + MAN_BITS),
    decoded in integer and exact float32 arithmetic: E2M1, E4M3 and E5M2 alike (no
    NaN or Inf codes; the formats saturate)."""
    bias: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    mag = code & ((1 << (EXP_BITS + MAN_BITS)) - 1)
    exp = mag >> MAN_BITS
    man = (mag & ((1 << MAN_BITS) - 1)).to(tl.float32)
    value = tl.where(exp == 0, man * pow2(tl.zeros_like(exp) + (1 - bias - MAN_BITS)),
                     (man + (1 << MAN_BITS)) * pow2(exp - (bias + MAN_BITS)))
    return tl.where((code >> (EXP_BITS + MAN_BITS)) != 0, -value, value)
