"""MX / NVFP4 element arithmetic shared by the Triton kernels (encode and decode).

Everything is integer bit manipulation or exact float32 arithmetic, so the kernels
reproduce ``dma_jax.formats`` bit for bit (DESIGN.md §3.1).
"""

import triton
import triton.language as tl

FLOAT32_NORMAL_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126

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
    """float32 subnormals become zeros of the same sign (as ``dma_jax.formats``)."""
    sign = (x.to(tl.uint32, bitcast=True) & 0x80000000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < FLOAT32_NORMAL_MIN, sign, x)


@triton.jit
def div_by(a, b, rb):
    """``div_rn(a, b)`` for b > 0 whose reciprocal ``rb = div_rn(1, b)`` is a normal
    float, in one multiply and two FMAs (Markstein's correction) instead of a full
    division per element. The corrected quotient is the correctly rounded one wherever
    that is a normal float (no mismatch in 1.2e8 random pairs shaped like the
    quantizer's, NOTES.md). Where ``a · rb`` is zero or subnormal it is returned as
    it is: its sign is the quotient's, and every caller rounds such values to a zero
    of that sign. A non-finite a gives a non-finite result (NaN where a division
    gives Inf), which callers zero like any non-finite value."""
    q = a * rb
    r = tl.fma(-q, b, a)
    return tl.where(tl.abs(q) < FLOAT32_NORMAL_MIN, q, tl.fma(r, rb, q))


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
def round_e4m3(v, HW: tl.constexpr):
    """``round_to_element(v, 3, -6, 448.0)`` for finite v. HW (a GPU; sm_89+): the
    conversion instruction (``cvt.rn.satfinite.e4m3x2.f32``: nearest, ties to even,
    E4M3 subnormals included, saturating at 448, signed zeros kept) instead of about a
    dozen integer-pipe instructions, the quantizer's bottleneck. Triton's interpreter
    does not round that conversion to nearest, so it keeps the emulation."""
    if HW:
        return v.to(tl.float8e4nv).to(tl.float32)
    else:
        return round_to_element(v, 3, -6, 448.0)


@triton.jit
def round_e4m3_on_grid_or_small(y, HW: tl.constexpr):
    """``round_to_element(y, 3, -6, 448.0)`` for finite y that is either an E4M3 value
    already or below E4M3's normal range (|y| < 2^-6). HW: ``round_e4m3``'s conversion
    instruction. Otherwise both cases round on E4M3's smallest quantum 2^-9 (an E4M3
    value is a multiple of it), so one fixed scale replaces the per-element exponent
    arithmetic."""
    if HW:
        return round_e4m3(y, True)
    else:
        return _round_to_quantum(y, 512.0, 0.001953125, y)


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
def e4m3_code(r):
    """E4M3 bit pattern (uint8) of r, which must already be an E4M3 value (rounded by
    ``round_to_element(v, 3, -6, 448.0)`` or ``round_e4m3_on_grid_or_small``): as
    ``element_code(r, 4, 3, -6)``, but the conversion has nothing to round, so it is
    exact whatever rounding a backend uses, and on sm_89+ it is one instruction per
    two elements instead of a dozen integer operations per element."""
    return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), still as float32.

    Triton's interpreter casts float32 to bf16 by truncation (measured with
    triton 3.9; GPUs round to nearest even), so interpreted kernels round first.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)
